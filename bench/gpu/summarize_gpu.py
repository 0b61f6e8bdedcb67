#!/usr/bin/env python3
"""The short summary run_gpu.sh prints last: GPU tests per binary, locus-train against PyTorch
(eager, CUDA graphs, compile) on the Fashion-MNIST MLP with ratios, data wait, the streamed
runs' host->device rate against the measured pinned peak; SimpleNet 1024-512-10 Adam the same
way (run_gpu.sh's simplenet phase: locus-train cached and streamed against PyTorch eager and
graph, both on the file make_simplenet_data.py wrote); and PyTorch's other workloads.

  summarize_gpu.py --gpu 0|1 --tests tests.tsv --locus gpu_train_bench.tsv --torch torch_gpu_bench.jsonl
                   [--simplenet simplenet/gpu_train_bench.tsv]
"""
import argparse
import csv
import json
import os

FM_SAMPLE_BYTES = 784 * 4 + 4  # float32 features + an int32 label


def read_tsv(path):
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f, delimiter="\t"))


def read_jsonl(path):
    out = []
    if path and os.path.exists(path):
        for line in open(path):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def fmt(x, f="{:.0f}"):
    return "-" if x is None else f.format(x)


def ratio(a, b):
    return "-" if a is None or not b else f"{a / b:.2f}"


# Tests that skip everything on a host with one GPU by design: the NCCL ones at 2 ranks outside
# the host-id phase (NCCL refuses two ranks on one GPU -- the link's test checks that refusal
# before it skips; the host-id phase runs them all).
SKIP_EXPECTED_ON_GPU = {"app_train_nccl.np2", "test_nccl_link.np2", "test_nccl_reducer.np2"}


def skipped_on_gpu(r):
    """A row that ran but skipped everything: on a GPU host a sign that the device was not seen
    (a driver / runtime mismatch, a library path), never a pass."""
    if r["test"] in SKIP_EXPECTED_ON_GPU:
        return False
    if r["status"] == "skipped":
        return True
    return r["status"] == "ok" and r["passed"] == "0" and r["skipped"].isdigit() and int(r["skipped"]) > 0


def tests_part(rows, gpu=False):
    lines = ["GPU tests (gtest; passed / failed / skipped)"]
    if not rows:
        return lines + ["  none run (no GPU test binaries in the bundle, or SKIP)"]
    tot = [0, 0, 0]
    for r in rows:
        lines.append(f"  {r['test']:<40} np{r['ranks']:<3} {r['status']:<8} {r['passed']:>4} {r['failed']:>4} {r['skipped']:>4}  {r['seconds']}s")
        for i, k in enumerate(("passed", "failed", "skipped")):
            tot[i] += int(r[k]) if r[k].isdigit() else 0
    bad = [r["test"] for r in rows if r["status"] not in ("ok", "skipped", "not run")]
    bad += [r["test"] + " (all skipped on a GPU host)" for r in rows if gpu and skipped_on_gpu(r)]
    unrun = [r["test"] for r in rows if r["status"] == "not run"]
    lines.append(f"  total: {tot[0]} passed, {tot[1]} failed, {tot[2]} skipped; binaries not ok: {', '.join(bad) or 'none'}")
    if unrun:
        lines.append(f"  not run (the phase's budget or the run's deadline was spent): {', '.join(unrun)}")
    return lines


def torch_index(recs):
    idx = {}
    for r in recs:
        if r.get("kind") == "train" and r.get("status") == "ok":
            idx[(r["workload"], r["precision"], r["batch"], r["feed"], r["mode"])] = r
    return idx


def locus_part(rows, tidx, peaks):
    if not rows and not any(k[0] == "fashion-mnist" for k in tidx):
        return ["", "Fashion-MNIST 784-256-128-10: not run (SKIP, the deadline, or no table)"]
    lines = ["", "Fashion-MNIST 784-256-128-10, samples/s: locus-train (cuda; cached = device cache, stream "
             "= pinned host batches, str8 = the same by 8 gather threads, map = loader.gather = device; "
             "graphs on) vs PyTorch (resident "
             "data unless 'str')"]
    lines.append(f"  {'prec':<5}{'batch':>6} {'L cached':>9}{'L stream':>9}{'L str8':>9}{'L map':>9}{'L eager':>9}{'wait% c/s/s8/m':>20} "
                 f"{'T eager':>9}{'T graph':>9}{'T g-str':>9}{'T comp':>9}  {'Lc/Te':>6}{'Lc/Tg':>6}{'Ls/Tgs':>7}"
                 f"{'L H2D GB/s':>11}")
    loc = {}
    for r in rows:
        loc[(r["backend"], r["precision"], r["batch"], r["cache_mb"], r["graphs"])] = r
    h2d_peak = peaks.get("h2d_pinned_GB_s")
    for prec in ("fp32", "bf16"):
        for b in ("128", "1024", "8192"):
            lc = loc.get(("cuda", prec, b, "1024", "true"), {})
            ls = loc.get(("cuda", prec, b, "0", "true"), {})
            le = loc.get(("cuda", prec, b, "1024", "false"), {})
            lm = loc.get(("cuda", prec, b, "map", "true"), {})
            l8 = loc.get(("cuda", prec, b, "0t8", "true"), {})
            s8 = num(l8.get("samples_per_s"))
            c, s, e = num(lc.get("samples_per_s")), num(ls.get("samples_per_s")), num(le.get("samples_per_s"))
            m = num(lm.get("samples_per_s"))
            waits = "/".join(fmt(w and 100 * w, "{:.1f}")
                             for w in (num(x.get("data_wait_fraction")) for x in (lc, ls, l8, lm)))
            t = {m: num(tidx.get(("fashion-mnist", prec, int(b), f, m), {}).get("samples_per_s"))
                 for m, f in (("eager", "resident"), ("graph", "resident"), ("compile", "resident"))}
            tgs = num(tidx.get(("fashion-mnist", prec, int(b), "stream", "graph"), {}).get("samples_per_s"))
            h2d = s * FM_SAMPLE_BYTES / 1e9 if s else None
            lines.append(f"  {prec:<5}{b:>6} {fmt(c):>9}{fmt(s):>9}{fmt(s8):>9}{fmt(m):>9}{fmt(e):>9}{waits:>20} "
                         f"{fmt(t['eager']):>9}{fmt(t['graph']):>9}{fmt(tgs):>9}{fmt(t['compile']):>9}  "
                         f"{ratio(c, t['eager']):>6}{ratio(c, t['graph']):>6}{ratio(s, tgs):>7}"
                         f"{fmt(h2d, '{:.2f}'):>11}")
    lines.append(f"  wait% = data_wait_fraction of the cached / streamed / str8 / map runs; L H2D = streamed samples/s x {FM_SAMPLE_BYTES} B "
                 f"(pinned peak measured: {fmt(h2d_peak, '{:.1f}')} GB/s)")
    fails = [r for r in rows if r["status"] != "ok"]
    if fails:
        lines.append(f"  locus rows not ok: {len(fails)} of {len(rows)}; first: "
                     f"{fails[0]['backend']}:{fails[0]['precision']}:{fails[0]['batch']}:{fails[0]['cache_mb']} "
                     f"{fails[0]['status']} {fails[0].get('note', '')[:120]}")
    cpu = [r for r in rows if r["backend"] == "cpu" and r["status"] == "ok"]
    for r in cpu:
        lines.append(f"  cpu backend reference: batch {r['batch']}: {r['samples_per_s']} samples/s")
    return lines


def simplenet_part(rows, tidx, recs):
    """SimpleNet: locus-train cached and streamed (graphs on) against PyTorch eager and graph."""
    torch_sn = [r for r in recs if r.get("kind") == "train" and r.get("workload") == "simplenet"]
    if not rows and not torch_sn:
        return []
    files = sorted({r.get("data") or "random data" for r in torch_sn if r.get("status") == "ok"})
    same = "PyTorch on " + (", ".join(os.path.basename(f) for f in files) if files else "-")
    lines = ["", f"SimpleNet 1024-512-10 Adam, samples/s: locus-train (cuda, graphs on; cached = device cache, "
             f"stream = pinned host batches) vs PyTorch (resident data unless 'str'; {same})"]
    lines.append(f"  {'prec':<5}{'batch':>6} {'L cached':>9}{'L stream':>9}{'wait%':>6} "
                 f"{'T eager':>9}{'T graph':>9}{'T g-str':>9}  {'Lc/Te':>6}{'Lc/Tg':>6}{'Ls/Tgs':>7}")
    loc = {}  # (precision, batch, cached?) of the cuda rows with graphs on
    for r in rows:
        if r["backend"] == "cuda" and r["graphs"] in ("true", "-") and r["batch"].isdigit():
            loc[(r["precision"], int(r["batch"]), r["cache_mb"] != "0")] = r
    keys = {k[:2] for k in loc} | {(r["precision"], r["batch"]) for r in torch_sn}
    for prec, b in sorted(keys, key=lambda k: (k[0] != "fp32", k[0], k[1])):
        lc, ls = loc.get((prec, b, True), {}), loc.get((prec, b, False), {})
        c, st = num(lc.get("samples_per_s")), num(ls.get("samples_per_s"))
        wait = num(ls.get("data_wait_fraction"))
        t = {k: num(tidx.get(("simplenet", prec, b, f, m), {}).get("samples_per_s"))
             for k, f, m in (("eager", "resident", "eager"), ("graph", "resident", "graph"),
                             ("gstr", "stream", "graph"))}
        lines.append(f"  {prec:<5}{b:>6} {fmt(c):>9}{fmt(st):>9}{fmt(wait and 100 * wait, '{:.1f}'):>6} "
                     f"{fmt(t['eager']):>9}{fmt(t['graph']):>9}{fmt(t['gstr']):>9}  "
                     f"{ratio(c, t['eager']):>6}{ratio(c, t['graph']):>6}{ratio(st, t['gstr']):>7}")
    if not rows:
        lines.append("  locus-train: not run (no GPU, SKIP, or the phase gave no table)")
    fails = [r for r in rows if r["status"] != "ok"]
    for r in fails[:2]:
        lines.append(f"  locus row not ok: {r['backend']}:{r['precision']}:{r['batch']}:{r['cache_mb']} "
                     f"{r['status']} {r.get('note', '')[:120]}")
    return lines


def torch_part(recs, tidx):
    lines = ["", "PyTorch, other workloads (samples/s; floor% = counts.py's device floor at the measured peaks / step time)"]
    seen = sorted({(k[0], k[1], k[2]) for k in tidx if k[0] != "fashion-mnist"})
    for w, p, b in seen:
        cells = []
        for f, m in (("resident", "eager"), ("resident", "graph"), ("resident", "compile"), ("stream", "graph")):
            r = tidx.get((w, p, b, f, m))
            if r:
                fl = r.get("of_device_floor")
                cells.append(f"{m}{'/str' if f == 'stream' else ''} {r['samples_per_s']:.0f}"
                             + (f" ({100 * fl:.0f}%)" if fl else ""))
        lines.append(f"  {w:<10}{p:<5}{b:>6}  " + "  ".join(cells))
    bad = [r for r in recs if r.get("kind") == "train" and r.get("status") == "failed"]
    for r in bad[:4]:
        lines.append(f"  FAILED {r['workload']} {r['precision']} {r['batch']} {r['feed']} {r['mode']}: {r['error'].splitlines()[0][:110]}")
    if len(bad) > 4:
        lines.append(f"  ... {len(bad) - 4} more failures in torch_gpu_bench.jsonl")
    impl = sorted({r.get("opt_impl", "?") + (" capturable" if r.get("capturable") else "")
                   for r in recs if r.get("kind") == "train" and r.get("status") == "ok"})
    if impl:
        lines.append(f"  optimizer implementations used: {', '.join(impl)}")
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gpu", default="1")
    p.add_argument("--gpu-name", default="", help="the device's name where PyTorch's phase did not run")
    p.add_argument("--tests")
    p.add_argument("--locus")
    p.add_argument("--torch")
    p.add_argument("--simplenet", help="gpu_train_bench.tsv of run_gpu.sh's simplenet phase")
    a = p.parse_args()
    recs = read_jsonl(a.torch)
    env = next((r for r in recs if r.get("kind") == "env"), {})
    peaks = next((r for r in recs if r.get("kind") == "peaks"), {})
    gpu = env.get("gpu") or a.gpu_name or "?"
    out = [f"=== GPU verification summary: {'GPU ' + gpu if a.gpu == '1' else 'NO GPU (CPU-side checks only)'}"
           f"; torch {env.get('torch', '?')} cuda {env.get('cuda', '-')}"]
    if peaks:
        out.append(f"peaks (size {peaks.get('size')}): pinned H2D {fmt(peaks.get('h2d_pinned_GB_s'), '{:.1f}')} GB/s, "
                   f"D2D {fmt(peaks.get('d2d_TB_s'), '{:.2f}')} TB/s, matmul bf16 {fmt(peaks.get('matmul_bf16_TFLOP_s'))} "
                   f"tf32 {fmt(peaks.get('matmul_tf32_TFLOP_s'))} fp32 {fmt(peaks.get('matmul_fp32_TFLOP_s'), '{:.1f}')} TFLOP/s")
    out += tests_part(read_tsv(a.tests), gpu=a.gpu == "1")
    tidx = torch_index(recs)
    out += locus_part(read_tsv(a.locus), tidx, peaks)
    out += simplenet_part(read_tsv(a.simplenet), tidx, recs)
    out += torch_part(recs, tidx)
    print("\n".join(out))


if __name__ == "__main__":
    main()
