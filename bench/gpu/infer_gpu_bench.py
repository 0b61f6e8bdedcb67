#!/usr/bin/env python3
"""locus-infer on the GPU against h5py + PyTorch CUDA, end to end on the same >= 1M-row file
(bench/RESULTS.md, "GPU inference"). Both read the same bytes (an HDF5 file of float32 features
[N, 784] and int32 labels, page-cached after it is written), score them with the same random
784-256-128-10 ReLU model (softmax probabilities, argmax, top-3, accuracy and log-loss) and
write the same datasets, made durable (fsync) at the end.

  locus:   locus-infer --infer.backend=cuda, 1 rank (the time from its report: setup, scoring,
           publication, less seconds_init -- the CUDA context, cuBLASLt and the model, which
           PyTorch's clock leaves out too; beside it the report's whole seconds_total, and the
           process's wall time including MPI and CUDA start-up), its
           features read by infer.read_threads = 0 (automatic: up to 8 pread threads) and,
           alternated with it, by 1 thread; also --ranks N (default 4) ranks sharing the GPU
           under mpirun
  PyTorch: h5py reads of BLOCK rows -> pinned tensor -> .cuda(non_blocking) -> the model ->
           softmax/argmax/topk -> .cpu() -> h5py writes of the block, then flush + fsync
           (CUDA context and cuBLAS warmed up first, not timed; its process wall time is also
           printed)
  bound:   min(file read bandwidth, H2D bandwidth) / bytes per row: the warm read of the whole
           file into memory (one buffer; os.readv from 1 thread, os.preadv from 8 threads, the
           better) and a pinned 256 MiB host->device copy

Prints the measurements, then one summary line starting with 'infer_gpu' (run_gpu.sh's table).
  infer_gpu_bench.py --apps BUNDLE/apps --work DIR [--rows 1048576] [--batch 8192] [--out TSV]
  --device cpu: the same steps with infer.backend=cpu and PyTorch on the CPU (no H2D bound), so
  that a machine without a GPU checks the script and the apps' reports it reads (run_gpu.sh
  does this on small inputs when there is no GPU); its figures say nothing about a GPU.
"""
import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import h5py  # noqa: E402
import numpy as np  # noqa: E402

WIDTHS = [784, 256, 128, 10]
TOP_K = 3


def make_input(path, rows, seed=0):
    """float32 features in [0, 1) (a 65536-row random block tiled) and int32 labels, chunked
    by 4096 rows as locus-ingest writes them."""
    rng = np.random.default_rng(seed)
    block = rng.random((65536, WIDTHS[0]), dtype=np.float32)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("features", (rows, WIDTHS[0]), np.float32, chunks=(4096, WIDTHS[0]))
        for lo in range(0, rows, len(block)):
            hi = min(rows, lo + len(block))
            x[lo:hi] = block[: hi - lo]
        f["labels"] = rng.integers(0, WIDTHS[-1], size=rows).astype(np.int32)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def write_model(path, seed=1):
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        for i in range(len(WIDTHS) - 1):
            f[f"layers.{i}.weight"] = (rng.standard_normal((WIDTHS[i + 1], WIDTHS[i])) *
                                       np.sqrt(2.0 / WIDTHS[i])).astype(np.float32)
            f[f"layers.{i}.bias"] = (rng.standard_normal(WIDTHS[i + 1]) * 0.1).astype(np.float32)
        f.attrs["locus_format"] = "locus-model"
        f.attrs["schema_version"] = 1
        f.attrs["widths"] = np.array(WIDTHS, dtype=np.int64)
        f.attrs["activation"] = "relu"
        f.attrs["loss"] = "cross_entropy"


def read_bandwidth(path, threads=1, repeats=3):
    """GB/s of reading the whole (page-cached) file into one buffer, best of `repeats`: 64 MiB
    pieces, from `threads` threads (os.preadv releases the GIL) each taking every threads-th."""
    size = os.path.getsize(path)
    buf = bytearray(size)
    view = memoryview(buf)
    piece = 64 << 20
    starts = list(range(0, size, piece))

    def read_pieces(fd, first):
        got = 0
        for lo in starts[first::threads]:
            hi = min(size, lo + piece)
            while lo < hi:
                n = os.preadv(fd, [view[lo:hi]], lo)
                if n <= 0:
                    raise RuntimeError(f"short read of {path} at {lo}")
                lo += n
                got += n
        return got

    best = 0.0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            fd = os.open(path, os.O_RDONLY)
            t = time.perf_counter()
            got = sum(pool.map(lambda i: read_pieces(fd, i), range(threads)))
            dt = time.perf_counter() - t
            os.close(fd)
            best = max(best, got / dt / 1e9)
    return best


def h2d_bandwidth(torch):
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, n / (time.perf_counter() - t) / 1e9)
    return best


def tail(text, n=20):
    return "\n".join(text.strip().splitlines()[-n:])


def run_locus(apps, model, data, out, batch, device, ranks=1, extra=(), timeout=45):
    """(wall, report, stdout), or None after printing 'infer_gpu FAILED ...' (a failed or hung
    run must not cost the other side's figures)."""
    launch = [] if ranks == 1 else ["mpirun", "--allow-run-as-root", "--oversubscribe",
                                    "--bind-to", "none", "-n", str(ranks)]
    cmd = [*launch, os.path.join(apps, "locus-infer"), f"--infer.model={model}", f"--infer.input={data}",
           f"--infer.output={out}", f"--infer.backend={device}", f"--infer.batch_rows={batch}",
           f"--infer.top_k={TOP_K}", "--overwrite", *extra]
    env = dict(os.environ, OMPI_MCA_ess_singleton_isolated="1")
    # timeout(1) ends a hung run with SIGTERM, which mpirun hands to its ranks (a SIGKILL of
    # mpirun alone could leave them holding the GPU); the Python limit is the backstop.
    cmd = ["timeout", "-k", "5", str(timeout), *cmd]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout + 15)
    except subprocess.TimeoutExpired as e:
        out_text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(f"infer_gpu FAILED locus-infer ({ranks} rank(s)): no end within {timeout} s\n{tail(out_text)}")
        return None
    except OSError as e:  # no such program
        print(f"infer_gpu FAILED locus-infer ({ranks} rank(s)): {e}")
        return None
    wall = time.perf_counter() - t
    if p.returncode in (124, 137):
        print(f"infer_gpu FAILED locus-infer ({ranks} rank(s)): no end within {timeout} s\n"
              f"{tail(p.stdout)}\n{tail(p.stderr)}")
        return None
    if p.returncode != 0:
        print(f"infer_gpu FAILED locus-infer ({ranks} rank(s)): rc {p.returncode}\n"
              f"{tail(p.stdout)}\n{tail(p.stderr)}")
        return None
    try:
        with open(out + ".report.json") as f:
            rep = json.load(f)
    except (OSError, ValueError) as e:
        print(f"infer_gpu FAILED locus-infer ({ranks} rank(s)): no readable report: {e}")
        return None
    return wall, rep, p.stdout


def run_torch(torch, model_path, data, out, block, device):
    dev = torch.device(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with h5py.File(model_path, "r") as f:
        layers = []
        for i in range(len(WIDTHS) - 1):
            lin = torch.nn.Linear(WIDTHS[i], WIDTHS[i + 1])
            lin.weight.data = torch.from_numpy(f[f"layers.{i}.weight"][:])
            lin.bias.data = torch.from_numpy(f[f"layers.{i}.bias"][:])
            layers += [lin, torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers[:-1]).eval().to(dev)
    with torch.no_grad():  # warm-up: context, cuBLAS handles, kernels (not timed)
        net(torch.zeros(block, WIDTHS[0], device=dev)).softmax(1).topk(TOP_K, 1)
    sync()
    c = WIDTHS[-1]
    t = time.perf_counter()
    with h5py.File(data, "r") as fin, h5py.File(out, "w") as fout, torch.no_grad():
        x, y = fin["features"], fin["labels"]
        n = x.shape[0]
        scores = fout.create_dataset("scores", (n, c), np.float32)
        pred = fout.create_dataset("predicted", (n,), np.int32)
        tkc = fout.create_dataset("topk_classes", (n, TOP_K), np.int32)
        tks = fout.create_dataset("topk_scores", (n, TOP_K), np.float32)
        pinned = torch.empty((block, WIDTHS[0]), dtype=torch.float32,
                             pin_memory=device == "cuda")
        correct, loss = 0, 0.0
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            host = pinned[: hi - lo]
            x.read_direct(host.numpy(), np.s_[lo:hi])
            z = net(host.to(dev, non_blocking=True))
            p = z.softmax(1)
            v, i = p.topk(TOP_K, 1)
            labels = torch.from_numpy(y[lo:hi]).to(dev).long()
            loss += float(torch.nn.functional.cross_entropy(z.double(), labels, reduction="sum"))
            correct += int((i[:, 0] == labels).sum())
            scores[lo:hi] = p.cpu().numpy()
            pred[lo:hi] = i[:, 0].int().cpu().numpy()
            tkc[lo:hi] = i.int().cpu().numpy()
            tks[lo:hi] = v.cpu().numpy()
        fout.flush()
        os.fsync(fout.id.get_vfd_handle())
    return time.perf_counter() - t, correct / n, loss / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--apps", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--batch", type=int, default=8192, help="locus infer.batch_rows")
    ap.add_argument("--block", type=int, default=65536, help="PyTorch rows per h5py read")
    ap.add_argument("--ranks", type=int, default=4, help="also run locus-infer on this many ranks (0: no)")
    ap.add_argument("--out", default="", help="TSV of the figures")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a check of the script without a GPU (infer.backend=cpu)")
    a = ap.parse_args()
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        print("infer_gpu: no GPU (torch.cuda.is_available() is False): not run")
        return 0
    os.makedirs(a.work, exist_ok=True)
    data, model = os.path.join(a.work, "infer-input.h5"), os.path.join(a.work, "infer-model.h5")
    t = time.perf_counter()
    make_input(data, a.rows)
    write_model(model)
    size = os.path.getsize(data)
    row_bytes = WIDTHS[0] * 4 + 4  # what both read per row: features and the label
    print(f"input {data}: {a.rows} rows, {size / 1e9:.2f} GB ({time.perf_counter() - t:.1f} s to write)")
    read1_gbs = read_bandwidth(data, 1)
    read8_gbs = read_bandwidth(data, 8)
    read_gbs = max(read1_gbs, read8_gbs)
    h2d_gbs = h2d_bandwidth(torch) if a.device == "cuda" else float("inf")
    bound = min(read_gbs, h2d_gbs) * 1e9 / row_bytes
    print(f"file read (warm) {read1_gbs:.2f} GB/s from 1 thread, {read8_gbs:.2f} GB/s from 8; "
          f"pinned H2D {h2d_gbs:.2f} GB/s; {row_bytes} B/row: "
          f"bound {bound / 1e6:.2f} M rows/s ({'read' if read_gbs < h2d_gbs else 'H2D'}-bound)")

    res = {}
    # alternated; the better of two each. locus1: infer.read_threads = 1 (one reading thread).
    for name in ("locus", "torch", "locus1", "locus", "torch", "locus1"):
        if name.startswith("locus"):
            extra = ["--infer.read_threads=1"] if name == "locus1" else []
            got = run_locus(a.apps, model, data, os.path.join(a.work, "locus-out.h5"),
                            a.batch, a.device, extra=extra)
            if got is None:
                continue
            wall, rep, text = got
            # Like for like with PyTorch's clock, which starts after its CUDA context, cuBLAS
            # and model are ready: run_inference's time less its seconds_init (the same).
            total, init = rep["seconds_total"], rep["seconds_init"]
            s = total - init
            pr = rep["per_rank"][0]
            print(f"locus-infer ({rep['read']}): {s:.3f} s after init ({total:.3f} s in "
                  f"run_inference: init {init:.3f}, setup {total - init - rep['seconds']:.3f} "
                  f"(input, output file, engine), scoring "
                  f"{rep['seconds']:.3f} s: read {pr['seconds_read']:.3f}, compute "
                  f"{pr['seconds_compute']:.3f}, write {pr['seconds_write']:.3f}, wait "
                  f"{pr['seconds_wait']:.3f}, compute idle {pr['seconds_idle']:.3f}, durable "
                  f"{rep['seconds_durable']:.3f}), {wall:.3f} s process wall; accuracy "
                  f"{rep['metrics']['accuracy']:.4f}, log-loss {rep['metrics']['log_loss']:.5f}")
            r = res.setdefault(name, {"s": 1e9, "wall": 1e9})
            if s < r["s"]:  # the better run's figures, together
                r["s"], r["total"], r["init"] = s, total, init
            r["wall"] = min(r["wall"], wall)
            r["acc"], r["loss"] = rep["metrics"]["accuracy"], rep["metrics"]["log_loss"]
            r["read"] = rep["read"]
        else:
            try:
                s, acc, loss = run_torch(torch, model, data, os.path.join(a.work, "torch-out.h5"),
                                         a.block, a.device)
            except Exception as e:  # noqa: BLE001 -- any failure: say so, keep locus's figures
                print(f"infer_gpu FAILED h5py + PyTorch: {e!r}")
                continue
            print(f"h5py + PyTorch: {s:.3f} s (after warm-up); accuracy {acc:.4f}, log-loss {loss:.5f}")
            r = res.setdefault("torch", {"s": 1e9})
            r["s"] = min(r["s"], s)
            r["acc"], r["loss"] = acc, loss
    if "locus" not in res or "torch" not in res:
        print(f"infer_gpu NO COMPARISON: {'locus-infer' if 'locus' not in res else 'h5py + PyTorch'} "
              "gave no run (the FAILED lines above say why)")
        return 1
    dp, agree, n = float("nan"), float("nan"), min(a.rows, 262144)
    try:
        with h5py.File(os.path.join(a.work, "locus-out.h5"), "r") as f1, \
                h5py.File(os.path.join(a.work, "torch-out.h5"), "r") as f2:
            dp = float(np.abs(f1["scores"][:n] - f2["scores"][:n]).max())
            agree = float(np.mean(f1["predicted"][:n] == f2["predicted"][:n]))
    except (OSError, KeyError, ValueError) as e:
        print(f"infer_gpu FAILED comparing the outputs: {e!r}")
    print(f"locus vs PyTorch on the first {n} rows: max |p| difference {dp:.2e}, argmax agreement {agree:.5f}")
    lr, tr = a.rows / res["locus"]["s"], a.rows / res["torch"]["s"]
    lt = a.rows / res["locus"]["total"]
    line = (f"infer_gpu {'' if a.device == 'cuda' else 'device=cpu '}rows={a.rows} locus={res['locus']['s']:.3f}s ({lr / 1e6:.2f} Mrows/s) "
            f"torch={res['torch']['s']:.3f}s ({tr / 1e6:.2f} Mrows/s) speedup={lr / tr:.2f}x "
            f"locus_total={res['locus']['total']:.3f}s (init {res['locus']['init']:.3f}s; "
            f"{lt / tr:.2f}x torch) "
            f"bound={bound / 1e6:.2f} Mrows/s ({'read' if read_gbs < h2d_gbs else 'H2D'} {min(read_gbs, h2d_gbs):.1f} GB/s) "
            f"locus/bound={lr / bound:.2f} locus_wall={res['locus']['wall']:.3f}s "
            f"read=\"{res['locus']['read']}\" max_dp={dp:.2e} argmax_agree={agree:.5f}")
    if "locus1" in res:
        line += (f" locus_read1={res['locus1']['s']:.3f}s "
                 f"({a.rows / res['locus1']['s'] / tr:.2f}x torch)")
    print(line)
    if a.out:
        with open(a.out, "w") as f:
            f.write("rows\tlocus_s\tlocus_wall_s\ttorch_s\tspeedup\tread_GB_s\th2d_GB_s\tbound_rows_s\tlocus_over_bound\tmax_dp\targmax_agree\tlocus_total_s\tlocus_init_s\n")
            f.write(f"{a.rows}\t{res['locus']['s']:.4f}\t{res['locus']['wall']:.4f}\t{res['torch']['s']:.4f}\t"
                    f"{lr / tr:.3f}\t{read_gbs:.3f}\t{h2d_gbs:.3f}\t{bound:.0f}\t{lr / bound:.3f}\t{dp:.3e}\t{agree:.6f}\t"
                    f"{res['locus']['total']:.4f}\t{res['locus']['init']:.4f}\n")
    # Last, after the 1-rank line is out: locus-infer on several ranks sharing the GPU.
    if a.ranks > 1:
        best = None
        for _ in range(2):
            got = run_locus(a.apps, model, data, os.path.join(a.work, "locus-np.h5"),
                            a.batch, a.device, ranks=a.ranks)
            if got is not None:
                s = got[1]["seconds_total"] - got[1]["seconds_init"]
                best = s if best is None else min(best, s)
        if best is not None:
            nr = a.rows / best
            print(f"locus-infer, {a.ranks} ranks on the one GPU: {best:.3f} s after init "
                  f"({nr / 1e6:.2f} M rows/s)")
            print(f"infer_gpu np{a.ranks} locus_np{a.ranks}={best:.3f}s ({nr / tr:.2f}x torch, "
                  f"{nr / bound:.2f} of bound)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
