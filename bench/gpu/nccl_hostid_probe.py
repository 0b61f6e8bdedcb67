"""Can two ranks of one NCCL communicator share one GPU when each claims another host?

NCCL refuses two ranks of a communicator on one device ("Duplicate GPU detected"). A test-only
way around it, reported to work with NCCL 2.29: give each rank its own NCCL_HOSTID and force
the socket transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket), so each rank looks
like another node. This probe tries it with PyTorch's NCCL on the GPU host, twice: without the
trick (expected: refused) and with it (an all-reduce of known values checked exactly). Never for
performance figures: the transport is TCP over loopback.
  python3 bench/gpu/nccl_hostid_probe.py [--timeout 60] [--cases plain,hostid]
Prints one line per case: "nccl_hostid <case> ok|refused|failed <detail>".
"""
import argparse
import os
import subprocess
import sys
import time


def worker(rank, world, port, trick):
    import torch
    import torch.distributed as dist
    env = os.environ
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(port)
    if trick:
        env.update(NCCL_HOSTID=f"locus-probe-{rank}", NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1",
                   NCCL_NET="Socket", NCCL_SOCKET_IFNAME="lo")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", 0))
    n = 1 << 20
    x = torch.arange(n, dtype=torch.float32, device="cuda") * (rank + 1)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    want = torch.arange(n, dtype=torch.float32, device="cuda") * sum(range(1, world + 1))
    ok = bool(torch.equal(x, want))
    print(f"rank {rank}: all_reduce {'exact' if ok else 'WRONG'}; nccl {torch.cuda.nccl.version()}",
          flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


def run_case(name, trick, port, timeout):
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--port", str(port)]
                              + (["--trick"] if trick else []),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs, rcs = [], []
    deadline = time.monotonic() + timeout  # one limit for the case, not one per process
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n(timeout)"
        outs.append(out)
        rcs.append(p.returncode)
    text = "\n".join(outs)
    if all(rc == 0 for rc in rcs) and text.count("exact") == 2:
        verdict = "ok"
    elif "Duplicate GPU" in text:
        verdict = "refused"
    else:
        verdict = "failed"
    detail = [l for l in text.splitlines() if "exact" in l or "Duplicate" in l or "rror" in l]
    print(f"nccl_hostid {name} {verdict} rc={rcs} {' | '.join(detail[:3])[:300]}", flush=True)
    return text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", type=int)
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--trick", action="store_true")
    ap.add_argument("--timeout", type=float, default=60, help="seconds a case may take")
    ap.add_argument("--cases", default="plain,hostid",
                    help="which to try, in order: plain (two ranks on one GPU as they are: NCCL "
                         "refuses them), hostid (a host id each)")
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker, 2, a.port, a.trick)
        return
    cases = a.cases.split(",")
    for c in cases:
        if c not in ("plain", "hostid"):
            sys.exit(f"nccl_hostid_probe.py: --cases: unknown case {c!r} (plain, hostid)")
    for c in cases:
        run_case(c, c == "hostid", a.port + (c == "hostid"), a.timeout)


if __name__ == "__main__":
    main()
