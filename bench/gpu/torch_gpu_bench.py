#!/usr/bin/env python3
"""PyTorch on the GPU, the reference for locus-train --train.backend=cuda: the workloads of
counts.py (nn.Linear stacks with ReLU, random init; cross-entropy; SGD momentum 0.9 nesterov,
Adam or AdamW as PyTorch picks its implementation for CUDA -- recorded -- or --opt-impl fused),
at the same batch and precision (fp32: allow_tf32 off; tf32: on; bf16: torch.autocast), in the
modes
  eager    one Python step: zero_grad, forward, loss, backward, optimizer.step
  graph    the whole step, optimizer included, captured once with torch.cuda.graph (the
           whole-network recipe of PyTorch's CUDA-graphs docs: side-stream warm-up, static
           inputs; Adam/AdamW with capturable=True) and replayed
  compile  torch.compile(mode="reduce-overhead") of model + loss, the optimizer step under
           torch.compile (resident feed, the --compile-only configurations: compiling takes
           tens of seconds each); failures are caught and reported
and two ways of feeding the batch:
  resident the dataset on the GPU; each step gathers a pre-shuffled index batch there
  stream   pre-gathered batches in pinned host memory, copied with non_blocking copies on a
           copy stream into one of two device slots while the previous step computes
The same run measures the peaks the ratios need: pinned host->device copy bandwidth, device-
to-device copy bandwidth (bytes read + written) and 8192^3 matrix products (bf16, tf32, fp32)
on random data. Timing: CUDA events around N steps (N chosen so one repetition takes about
--rep-ms), after warm-up; the median of --reps repetitions.

  torch_gpu_bench.py [--device cuda|cpu] [--quick] [--out FILE.jsonl] [--budget-s 300]
      [--workloads fashion-mnist,simplenet,deep-mlp] [--modes eager,graph,compile]
      [--feeds resident,stream] [--opt-impl default|foreach|fused] [--reps 5]
      [--simplenet-data FILE.h5]

The data is random (N(0, 1) features, uniform labels), except for simplenet with
--simplenet-data: then its rows come from that HDF5 file's /features [N, D] float and /labels
[N] integer (make_simplenet_data.py writes it; run_gpu.sh trains locus-train on the same file),
all N rows unless --rows (or --quick) caps them; under --quick only the first (cut) width of
the features is used.

JSON lines to --out (one per peak, per timed run, per failure), a short table to stdout.
`--device cpu --quick` is the smoke test for machines without a GPU (tiny sizes; graph mode is
reported as skipped). OPENBLAS_NUM_THREADS/OMP_NUM_THREADS are set before torch is imported.
"""
import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import counts  # noqa: E402

LR = {"sgd-nesterov": 0.05, "adam": 1e-3, "adamw": 3e-4}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny sizes and step counts (smoke test)")
    p.add_argument("--out", default="torch_gpu_bench.jsonl")
    p.add_argument("--workloads", default="fashion-mnist,simplenet,deep-mlp")
    p.add_argument("--precisions", default="", help="override every workload's precision, e.g. fp32,tf32,bf16")
    p.add_argument("--modes", default="eager,graph,compile")
    p.add_argument("--feeds", default="resident,stream")
    p.add_argument("--compile-only", default="fashion-mnist:fp32:1024,simplenet:fp32:64,deep-mlp:bf16:4096",
                   help="workload:precision:batch list that also runs compile mode, resident feed "
                        "only (it compiles for 20-60 s each); 'all' for every one")
    p.add_argument("--opt-impl", default="default", choices=["default", "foreach", "fused"])
    p.add_argument("--rows", type=int, default=None,
                   help="dataset rows (default Fashion-MNIST's 60000; with --simplenet-data: the "
                        "file's, capped by this when given)")
    p.add_argument("--simplenet-data", default="", metavar="FILE.h5",
                   help="simplenet trains on this HDF5 file's /features and /labels instead of random data")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=20, help="steps before timing (and before capture)")
    p.add_argument("--rep-ms", type=float, default=60.0, help="target time of one repetition")
    p.add_argument("--max-steps", type=int, default=3000, help="cap on steps per repetition")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="skip what is left (and say so) once this much wall time has passed")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (--device cpu)")
    p.add_argument("--no-peaks", action="store_true")
    p.add_argument("--no-kernel-count", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.reps, a.warmup, a.rep_ms, a.max_steps, a.rows = 2, 2, 1.0, 3, 512
        a.budget_s = min(a.budget_s, 120.0)
    a.data_rows = a.rows  # the cap on rows read from --simplenet-data (None: all of them)
    if a.rows is None:
        a.rows = 60000
    return a


class Run:
    """The output: JSON lines (flushed as written, so a killed run keeps what it measured)."""

    def __init__(self, path):
        self.f = open(path, "w")
        self.t0 = time.monotonic()
        self.results = []

    def emit(self, rec):
        rec["t_s"] = round(time.monotonic() - self.t0, 2)
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        self.results.append(rec)

    def elapsed(self):
        return time.monotonic() - self.t0


def timer(torch, dev):
    """fn(steps) -> seconds, CUDA events on the GPU, perf_counter on the CPU."""
    if dev.type == "cuda":
        def run(fn, n):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(n)
            e.record()
            e.synchronize()
            return s.elapsed_time(e) / 1e3
    else:
        def run(fn, n):
            t = time.perf_counter()
            fn(n)
            return time.perf_counter() - t
    return run


def set_tf32(torch, on):
    """fp32 matrix products on tensor cores (tf32) or not (ieee). PyTorch >= 2.9 has
    fp32_precision and warns about the old allow_tf32 flag; older ones only have the flag."""
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):
        m.fp32_precision = "tf32" if on else "ieee"
        return f"matmul.fp32_precision={m.fp32_precision}"
    m.allow_tf32 = on
    return f"matmul.allow_tf32={m.allow_tf32}"


def measure_peaks(torch, dev, a, run):
    time_it = timer(torch, dev)
    quick = a.quick or dev.type != "cuda"

    def med(fn, reps=10):
        fn(1)
        return statistics.median(time_it(fn, 1) for _ in range(reps))

    out = {}
    nbytes = (8 << 20) if quick else (256 << 20)
    try:
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory() if dev.type == "cuda" \
            else torch.empty(nbytes, dtype=torch.uint8)
        host.random_(0, 255)
        d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        t = med(lambda n: d.copy_(host, non_blocking=True))
        out["h2d_pinned_GB_s"] = nbytes / t / 1e9
        src = torch.empty((1 << 30) if not quick else nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
        dst = torch.empty_like(src)
        t = med(lambda n: dst.copy_(src))
        out["d2d_TB_s"] = 2 * src.numel() / t / 1e12  # read + written
        del src, dst, d, host
    except Exception as e:  # noqa: BLE001
        run.emit({"kind": "error", "what": "copy peaks", "error": repr(e)})
    n = 256 if quick else 8192
    for prec, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True),
                              ("fp32", torch.float32, False)):
        try:
            if dev.type == "cuda":
                set_tf32(torch, tf32)
            x = torch.randn(n, n, device=dev, dtype=dtype)
            y = torch.randn(n, n, device=dev, dtype=dtype)
            t = med(lambda k: torch.matmul(x, y), reps=10 if not quick else 2)
            out[f"matmul_{prec}_TFLOP_s"] = 2 * n ** 3 / t / 1e12
            del x, y
        except Exception as e:  # noqa: BLE001
            run.emit({"kind": "error", "what": f"matmul {prec}", "error": repr(e)})
    if dev.type == "cuda":
        set_tf32(torch, False)
    run.emit({"kind": "peaks", "size": n, **out})
    return out


def configs(a):
    wanted = set(a.workloads.split(","))
    seen = set()
    for name, widths, opt, batches, prec in counts.WORKLOADS:
        if name not in wanted:
            continue
        for p in (a.precisions.split(",") if a.precisions else [prec]):
            for full in batches:
                w, b = list(widths), full
                if a.quick:  # shapes kept, sizes cut: a logic test, not a measurement
                    w, b = [min(x, 128) for x in w], min(full, 32)
                if (name, p, b) in seen:
                    continue
                seen.add((name, p, b))
                cfg = {"workload": name, "widths": w, "optimizer": opt, "batch": b, "precision": p,
                       "full_batch": full}
                if name == "simplenet" and a.simplenet_data:
                    cfg["data"] = a.simplenet_data
                yield cfg


_LOADED = {}


def load_rows(torch, path, rows, d, ncls):
    """/features[:rows, :d] (float32) and /labels[:rows] (int64) of an HDF5 file as CPU tensors,
    read once per (path, rows, d); labels must lie in [0, ncls)."""
    key = (path, rows, d)
    if key not in _LOADED:
        import h5py
        import numpy as np
        with h5py.File(path, "r") as f:
            if "features" not in f or "labels" not in f:
                raise ValueError(f"{path}: needs datasets /features [N, D] and /labels [N] "
                                 "(make_simplenet_data.py writes them)")
            fx, fy = f["features"], f["labels"]
            if fx.ndim != 2 or fy.ndim != 1 or fy.shape[0] != fx.shape[0] or fx.shape[1] < d:
                raise ValueError(f"{path}: /features {fx.shape} and /labels {fy.shape}: need [N, >= {d}] "
                                 f"and [N]")
            n = fx.shape[0] if rows is None else min(rows, fx.shape[0])
            x = np.ascontiguousarray(fx[:n, :d], dtype=np.float32)
            y = fy[:n].astype(np.int64)
        if n and (y.min() < 0 or y.max() >= ncls):
            raise ValueError(f"{path}: labels span {y.min()}..{y.max()}; the model has {ncls} classes")
        _LOADED.clear()  # one file's rows held at a time
        _LOADED[key] = (torch.from_numpy(x), torch.from_numpy(y))
    return _LOADED[key]


def make_optimizer(torch, kind, params, impl, capturable):
    kw = {}
    if impl == "fused":
        kw["fused"] = True
    elif impl == "foreach":
        kw["foreach"] = True
    if kind == "sgd-nesterov":
        return torch.optim.SGD(params, lr=LR[kind], momentum=0.9, nesterov=True, **kw)
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    if capturable:
        kw["capturable"] = True
    if kind == "adamw":
        kw["weight_decay"] = 0.01
    return cls(params, lr=LR[kind], **kw)


def default_impl(torch, params):
    """Which implementation PyTorch picks when neither foreach nor fused is given."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
        try:
            fused, foreach = _default_to_fused_or_foreach(list(params), False, False)
        except TypeError:
            fused, foreach = _default_to_fused_or_foreach(list(params), differentiable=False, use_fused=False)
        return "fused" if fused else ("foreach" if foreach else "for-loop")
    except Exception:  # noqa: BLE001
        return "unknown"


def build(torch, cfg, dev):
    nn = torch.nn
    F = torch.nn.functional
    w = cfg["widths"]
    mods = []
    for i in range(len(w) - 1):
        mods.append(nn.Linear(w[i], w[i + 1]))
        if i + 2 < len(w):
            mods.append(nn.ReLU())
    bf16 = cfg["precision"] == "bf16"

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = nn.Sequential(*mods)

        def forward(self, x, y):
            ctx = torch.autocast(device_type=dev.type, dtype=torch.bfloat16) if bf16 \
                else contextlib.nullcontext()
            with ctx:
                out = self.m(x)
            return F.cross_entropy(out.float(), y)

    return WithLoss().to(dev)


class Feed:
    """Batches for step i: resident (gather on the device) or streamed from pinned host memory
    through two device slots filled on a copy stream one step ahead."""

    def __init__(self, torch, dev, cfg, rows, kind, data_rows=None):
        self.torch, self.dev, self.kind = torch, dev, kind
        b, d = cfg["batch"], cfg["widths"][0]
        g = torch.Generator(device="cpu").manual_seed(0)
        ncls = cfg["widths"][-1]
        X = Y = None
        if cfg.get("data"):  # the rows of a file (--simplenet-data) instead of random ones
            X, Y = load_rows(torch, cfg["data"], data_rows, d, ncls)
            rows = X.shape[0]
            if rows < b:
                raise ValueError(f"{cfg['data']}: {rows} rows, fewer than one batch of {b}")
        else:
            rows = max(rows, 2 * b)
        if kind == "resident":
            if X is None:
                X = torch.randn(rows, d, generator=g)
                Y = torch.randint(0, ncls, (rows,), generator=g)
            self.X, self.Y = X.to(dev), Y.to(dev)
            nb = rows // b
            self.idx = torch.randperm(rows, generator=g)[: nb * b].view(nb, b).to(dev)
            self.static_idx = self.idx[0].clone()
        else:
            k = max(2, min(8, (256 << 20) // (b * d * 4)))  # host batches cycled through
            pin = dev.type == "cuda"
            if X is None:
                self.HX = torch.randn(k, b, d, generator=g)
                self.HY = torch.randint(0, ncls, (k, b), generator=g)
            else:  # k batches of distinct rows of the file, as many as it holds
                k = max(1, min(k, rows // b))
                sel = torch.randperm(rows, generator=g)[: k * b]
                self.HX, self.HY = X[sel].view(k, b, d), Y[sel].view(k, b)
            if pin:
                self.HX, self.HY = self.HX.pin_memory(), self.HY.pin_memory()
            self.dX = [torch.empty(b, d, device=dev) for _ in range(2)]
            self.dY = [torch.empty(b, dtype=torch.int64, device=dev) for _ in range(2)]
            if pin:
                self.cs = torch.cuda.Stream()
                self.ready = [torch.cuda.Event() for _ in range(2)]
                self.free = [torch.cuda.Event() for _ in range(2)]
            self.next = 0

    def nbatches(self):
        return self.idx.shape[0] if self.kind == "resident" else self.HX.shape[0]

    # resident
    def gather(self, idx):
        return self.X.index_select(0, idx), self.Y.index_select(0, idx)

    # stream: issue the copy of step i's batch into slot i % 2
    def prefetch(self, i):
        s, k = i % 2, i % self.HX.shape[0]
        if self.dev.type != "cuda":
            self.dX[s].copy_(self.HX[k])
            self.dY[s].copy_(self.HY[k])
            return
        torch = self.torch
        self.cs.wait_event(self.free[s])
        with torch.cuda.stream(self.cs):
            self.dX[s].copy_(self.HX[k], non_blocking=True)
            self.dY[s].copy_(self.HY[k], non_blocking=True)
            self.ready[s].record(self.cs)

    def acquire(self, i):
        s = i % 2
        if self.dev.type == "cuda":
            self.torch.cuda.current_stream().wait_event(self.ready[s])
        return s

    def release(self, s):
        if self.dev.type == "cuda":
            self.free[s].record(self.torch.cuda.current_stream())


def eager_runner(torch, model, opt, feed):
    """fn(n): n eager steps."""
    state = {"i": 0}

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()

    if feed.kind == "resident":
        def fn(n):
            for _ in range(n):
                i = state["i"]
                step(*feed.gather(feed.idx[i % feed.nbatches()]))
                state["i"] = i + 1
    else:
        feed.prefetch(0)

        def fn(n):
            for _ in range(n):
                i = state["i"]
                feed.prefetch(i + 1)
                s = feed.acquire(i)
                step(feed.dX[s], feed.dY[s])
                feed.release(s)
                state["i"] = i + 1
    return fn, step


def graph_runner(torch, model, opt, feed, warmup):
    """fn(n): n replays of the captured whole step (one graph per input slot when streaming)."""
    if feed.dev.type != "cuda":
        raise NotImplementedError("CUDA graphs need --device cuda")

    def body_resident():
        x, y = feed.gather(feed.static_idx)
        model(x, y).backward()
        opt.step()

    def body_slot(s):
        model(feed.dX[s], feed.dY[s]).backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as the recipe says
        for i in range(max(3, warmup)):
            opt.zero_grad(set_to_none=True)
            if feed.kind == "resident":
                feed.static_idx.copy_(feed.idx[i % feed.nbatches()])
                body_resident()
            else:
                feed.prefetch(i)
                torch.cuda.current_stream().wait_stream(feed.cs)
                body_slot(i % 2)
                feed.release(i % 2)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for s in range(1 if feed.kind == "resident" else 2):
        g = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(g, pool=graphs[0].pool() if graphs else None):
            body_resident() if feed.kind == "resident" else body_slot(s)
        graphs.append(g)
    torch.cuda.synchronize()
    state = {"i": 0}
    if feed.kind == "resident":
        def fn(n):
            for _ in range(n):
                i = state["i"]
                feed.static_idx.copy_(feed.idx[i % feed.nbatches()], non_blocking=True)
                graphs[0].replay()
                state["i"] = i + 1
    else:
        # Graph replays run on the current stream; the copy stream fills the other slot.
        for s in range(2):
            feed.free[s].record(torch.cuda.current_stream())
        feed.prefetch(0)

        def fn(n):
            for _ in range(n):
                i = state["i"]
                feed.prefetch(i + 1)
                s = feed.acquire(i)
                graphs[s].replay()
                feed.release(s)
                state["i"] = i + 1
    return fn


def compile_runner(torch, model, opt, feed):
    if not hasattr(torch, "compile"):
        raise NotImplementedError(f"torch {torch.__version__} has no torch.compile")
    cmodel = torch.compile(model, mode="reduce-overhead")

    @torch.compile(fullgraph=False)
    def opt_step():  # PyTorch's "compiling the optimizer" recipe
        opt.step()
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)

    def step(x, y):
        if mark is not None:
            mark()
        opt.zero_grad(set_to_none=True)
        cmodel(x, y).backward()
        opt_step()

    state = {"i": 0}
    if feed.kind == "resident":
        def fn(n):
            for _ in range(n):
                i = state["i"]
                step(*feed.gather(feed.idx[i % feed.nbatches()]))
                state["i"] = i + 1
    else:
        feed.prefetch(0)

        def fn(n):
            for _ in range(n):
                i = state["i"]
                feed.prefetch(i + 1)
                s = feed.acquire(i)
                step(feed.dX[s], feed.dY[s])
                feed.release(s)
                state["i"] = i + 1
    return fn


def count_kernels(torch, fn, steps=3):
    """Kernels (and copies) the profiler sees per step: the launch count the floors assume."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(steps)
        torch.cuda.synchronize()
    n = sum(1 for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA"))
    return n / steps


def time_mode(torch, dev, a, fn, batch):
    time_it = timer(torch, dev)
    t_warm = time.perf_counter()
    fn(a.warmup)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t_warm = time.perf_counter() - t_warm
    one = time_it(fn, max(1, min(a.warmup, 10))) / max(1, min(a.warmup, 10))
    steps = int(min(a.max_steps, max(5 if not a.quick else 1, math.ceil(a.rep_ms / 1e3 / max(one, 1e-7)))))
    secs = [time_it(fn, steps) for _ in range(a.reps)]
    sps = sorted(batch * steps / s for s in secs)
    return {"steps_per_rep": steps, "reps": a.reps, "samples_per_s": statistics.median(sps),
            "samples_per_s_min": sps[0], "samples_per_s_max": sps[-1],
            "step_us": statistics.median(secs) / steps * 1e6, "warmup_s": round(t_warm, 3)}


def bench_config(torch, dev, a, run, cfg, peaks, modes, feeds):
    torch.manual_seed(0)
    floor = floors_for(cfg, peaks)
    for feed_kind in feeds:
        feed = None  # built once per feed kind, shared by the modes
        for mode in modes:
            base = {"kind": "train", **{k: v for k, v in cfg.items() if k != "full_batch"},
                    "mode": mode, "feed": feed_kind, "opt_impl_asked": a.opt_impl}
            if run.elapsed() > a.budget_s:
                run.emit({**base, "status": "skipped", "error": f"time budget {a.budget_s:g} s spent"})
                continue
            model = opt = None
            try:
                tf32_setting = set_tf32(torch, cfg["precision"] == "tf32") if dev.type == "cuda" else None
                model = build(torch, cfg, dev)
                params = list(model.parameters())
                impl = a.opt_impl if a.opt_impl != "default" else default_impl(torch, params)
                capturable = mode == "graph" and cfg["optimizer"] != "sgd-nesterov"
                opt = make_optimizer(torch, cfg["optimizer"], params, a.opt_impl, capturable)
                if feed is None:
                    feed = Feed(torch, dev, cfg, a.rows, feed_kind, a.data_rows)
                if mode == "eager":
                    fn, _ = eager_runner(torch, model, opt, feed)
                elif mode == "graph":
                    fn = graph_runner(torch, model, opt, feed, a.warmup)
                else:
                    fn = compile_runner(torch, model, opt, feed)
                res = time_mode(torch, dev, a, fn, cfg["batch"])
                kern = None
                if dev.type == "cuda" and not a.no_kernel_count and feed_kind == "resident":
                    try:
                        kern = count_kernels(torch, fn)
                    except Exception as e:  # noqa: BLE001
                        kern = f"profiler failed: {e!r}"[:200]
                rec = {**base, "status": "ok", "opt_impl": impl, "capturable": capturable,
                       "tf32_setting": tf32_setting, **res,
                       "kernels_per_step": kern, "floor_us": floor,
                       "of_device_floor": floor / res["step_us"] if floor else None}
                run.emit(rec)
            except Exception as e:  # noqa: BLE001
                run.emit({**base, "status": "failed" if not isinstance(e, NotImplementedError) else "skipped",
                          "error": f"{type(e).__name__}: {e}"[:2000],
                          "trace": traceback.format_exc()[-3000:]})
            finally:
                del model, opt
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()


def floors_for(cfg, peaks):
    """counts.py's device floor (max of compute and memory time) with the measured peaks."""
    w, b, p = cfg["widths"], cfg["batch"], cfg["precision"]
    rate = peaks.get(f"matmul_{p}_TFLOP_s")
    mem = peaks.get("d2d_TB_s")
    if not rate or not mem:
        return None
    f = counts.flops(w, b)
    by = sum(counts.device_bytes(w, b, cfg["optimizer"], p).values())
    return max(f / (rate * 1e12), by / (mem * 1e12)) * 1e6


def table(run):
    lines = []
    pk = next((r for r in run.results if r["kind"] == "peaks"), None)
    if pk:
        def g(k, fmt):
            return format(pk[k], fmt) if k in pk else "-"
        lines.append(f"peaks: pinned H2D {g('h2d_pinned_GB_s', '.1f')} GB/s, D2D {g('d2d_TB_s', '.2f')} "
                     f"TB/s, matmul {pk['size']}^3 bf16 {g('matmul_bf16_TFLOP_s', '.0f')} / tf32 "
                     f"{g('matmul_tf32_TFLOP_s', '.0f')} / fp32 {g('matmul_fp32_TFLOP_s', '.1f')} TFLOP/s")
    lines.append(f"{'workload':<14}{'prec':<5}{'batch':>6} {'feed':<9}{'mode':<8}{'samples/s':>12}"
                 f"{'us/step':>9}{'floor%':>7}{'kern':>6}  opt")
    for r in run.results:
        if r["kind"] != "train":
            continue
        head = f"{r['workload']:<14}{r['precision']:<5}{r['batch']:>6} {r['feed']:<9}{r['mode']:<8}"
        if r["status"] != "ok":
            lines.append(head + f"{r['status']}: {r['error'].splitlines()[0][:70]}")
            continue
        fl = f"{100 * r['of_device_floor']:.0f}" if r.get("of_device_floor") else "-"
        k = r["kernels_per_step"]
        k = f"{k:.0f}" if isinstance(k, (int, float)) else "-"
        lines.append(head + f"{r['samples_per_s']:>12.0f}{r['step_us']:>9.1f}{fl:>7}{k:>6}  {r['opt_impl']}"
                     + (" capt" if r.get("capturable") else ""))
    return "\n".join(lines)


def main():
    a = parse_args()
    if a.simplenet_data and not os.path.isfile(a.simplenet_data):
        print(f"torch_gpu_bench: --simplenet-data {a.simplenet_data}: no such file (write it with "
              "make_simplenet_data.py, or leave the option out for random data)", file=sys.stderr)
        return 2
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(a.threads))
    import torch  # noqa: E402  (after the thread variables on purpose)
    run = Run(a.out)
    if a.device == "cuda" and not torch.cuda.is_available():
        run.emit({"kind": "error", "what": "device", "error": "torch.cuda.is_available() is False"})
        print("torch_gpu_bench: no CUDA device visible to PyTorch (rerun with --device cpu --quick "
              "for the smoke test)", file=sys.stderr)
        return 3
    dev = torch.device(a.device)
    if dev.type == "cpu":
        torch.set_num_threads(a.threads)
    env = {"kind": "env", "torch": torch.__version__, "device": a.device, "quick": a.quick,
           "python": sys.version.split()[0], "simplenet_data": a.simplenet_data or None}
    if dev.type == "cuda":
        pr = torch.cuda.get_device_properties(0)
        env.update(gpu=pr.name, sms=pr.multi_processor_count, mem_GiB=round(pr.total_memory / 2**30, 1),
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    run.emit(env)
    peaks = {} if a.no_peaks else measure_peaks(torch, dev, a, run)
    comp_set = None if a.compile_only == "all" else set(a.compile_only.split(","))
    modes = [m for m in a.modes.split(",") if m != "compile"]
    cfgs = list(configs(a))
    for cfg in cfgs:
        bench_config(torch, dev, a, run, cfg, peaks, modes, a.feeds.split(","))
    if "compile" in a.modes.split(","):  # last: it is the slowest to set up
        for cfg in cfgs:
            key = f"{cfg['workload']}:{cfg['precision']}:{cfg['full_batch']}"
            if comp_set is None or key in comp_set or a.quick:
                bench_config(torch, dev, a, run, cfg, peaks, ["compile"], ["resident"])
    print(table(run))
    print(f"({len(run.results)} records in {a.out}, {run.elapsed():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
