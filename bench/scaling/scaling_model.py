#!/usr/bin/env python3
"""The scaling model of docs/SCALING.md: projects step, checkpoint and ingest times from 8 to
1024 nodes from constants measured on this project's machine (bench/RESULTS.md) and published
figures of a large cluster (cited in docs/SCALING.md). A plan with its numbers, not a claim:
nothing here was run on more than one host.

    bench/scaling/scaling_model.py              # the tables of docs/SCALING.md
    bench/scaling/scaling_model.py --o-us 2.0   # another per-message cost, etc. (--help)
"""
import argparse
import math

MB = 1e6
GB = 1e9
TB = 1e12
MiB = 1 << 20


def engine(n, ranks, chunk, o, b):
    """locus's chunked engine (lib/comm chunk_allreduce) over `ranks` ranks: every chunk is a
    direct-exchange reduce-scatter + allgather, 2(ranks-1) messages of chunk/ranks bytes per
    rank; the per-message cost o is paid for every message (one thread posts and tests them),
    the bytes move at b."""
    if ranks == 1:
        return 0.0
    chunks = math.ceil(n / chunk)
    return chunks * 2 * (ranks - 1) * o + 2 * n * (ranks - 1) / ranks / b


def allreduce_flat(n, nodes, per_node, o, b_net, chunk):
    """The engine over all P = N R ranks; the R ranks of a node share its network port."""
    return engine(n, nodes * per_node, chunk, o, b_net / per_node)


def intra_node(n, per_node, o, b_intra, chunk):
    """Reduce to the node leader and broadcast back: the leader receives and sends each node
    peer's whole chunk (lib/comm hier_allreduce)."""
    if per_node == 1:
        return 0.0
    return 2 * (per_node - 1) * n / b_intra + 2 * math.ceil(n / chunk) * (per_node - 1) * o


def allreduce_hier_built(n, nodes, per_node, o, b_net, b_intra, chunk, in_flight):
    """train.reduction = hierarchical as built: per chunk, the leaders form a chain in node
    order (each continues the previous node's running sum: rank order kept), then the last
    leader sends the result to every other leader. Per chunk the last leader's port carries
    (nodes-1) chunks out; the chain takes nodes-1 hops one after the other, `in_flight` chunks
    overlapping."""
    t = intra_node(n, per_node, o, b_intra, chunk)
    if nodes == 1:
        return t
    chunks = math.ceil(n / chunk)
    hop = o + chunk / b_net
    chain = (nodes - 1) * hop + (nodes - 1) * hop  # to the last leader, then its sends
    port = (nodes - 1) * chunk / b_net + chunk / b_net
    return t + chunks * max(chain / in_flight, port)


def allreduce_hier_pipelined(n, nodes, per_node, o, b_net, b_intra, chunk, piece):
    """The remedy (not built): the same ordered chain, pipelined in small pieces with as many
    in flight as the chain is long, and the result sent back down a binomial tree. Every link
    carries n bytes each way; the chain fills once: 2n/B + (nodes-1 + log2 nodes) hops."""
    t = intra_node(n, per_node, o, b_intra, chunk)
    if nodes == 1:
        return t
    hop = o + piece / b_net
    return t + 2 * n / b_net + (nodes - 1 + math.ceil(math.log2(nodes))) * hop * 2


def segment_bytes(chunk, ranks):
    return chunk / ranks


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    # Cluster (docs/SCALING.md, "Figures of the cluster"): stated, not measured here.
    ap.add_argument("--b-net-gbs", type=float, default=50.0,
                    help="network bandwidth per node and direction, GB/s (one NDR 400 Gb/s port)")
    ap.add_argument("--o-us", type=float, default=1.0,
                    help="cost per message of a posted send/receive pair, microseconds")
    ap.add_argument("--b-intra-gbs", type=float, default=450.0,
                    help="intra-node reduction bandwidth, GB/s (H100 NVLink: 450 GB/s a direction)")
    ap.add_argument("--per-node", type=int, default=8, help="ranks (GPUs) per node")
    ap.add_argument("--fs-gbs", type=float, default=5000.0,
                    help="file system aggregate bandwidth, GB/s (Perlmutter scratch: > 5 TB/s)")
    ap.add_argument("--file-gbs", type=float, default=72 * 5000.0 / 274,
                    help="bandwidth of one shared file, GB/s (72 OSTs of 274 OSSs' share)")
    ap.add_argument("--node-io-gbs", type=float, default=25.0,
                    help="file system bandwidth one node's client reaches, GB/s")
    ap.add_argument("--meta-s", type=float, default=0.05,
                    help="checkpoint commit latency: create, fsync, rename, directory fsync, s")
    ap.add_argument("--parse-mbs", type=float, default=110.0,
                    help="CSV parse rate per rank, MB/s (measured here: 105-114)")
    ap.add_argument("--ingest-ranks-per-node", type=int, default=64,
                    help="ingest ranks per node (one per core)")
    ap.add_argument("--chunk-mib", type=float, default=1.0, help="the reducer's chunk (MiB)")
    ap.add_argument("--in-flight", type=int, default=4, help="chunks in flight")
    a = ap.parse_args()

    b_net, b_intra = a.b_net_gbs * GB, a.b_intra_gbs * GB
    o = a.o_us * 1e-6
    R = a.per_node
    node_counts = [8, 16, 32, 64, 128, 256, 512, 1024]

    # Workload 1: the deep MLP of configs/deep-mlp.ini (8 x 2048, 33.6 M parameters), float32
    # gradients (134 MB), 512 rows per GPU and step. Compute per step from its FLOPs
    # (6 x params x rows) at an assumed 300 TFLOP/s sustained (bf16, H100): a plan figure.
    params = 33.6e6
    grads = 4 * params
    rows = 512
    t_compute = 6 * params * rows / 300e12
    print(f"# step: deep MLP, {params / 1e6:.1f} M parameters, {grads / MB:.0f} MB of float32 "
          f"gradients, {rows} rows per GPU, {R} GPUs per node; compute {t_compute * 1e3:.2f} ms "
          f"a step (6 x params x rows at 300 TFLOP/s)")
    print(f"# network {a.b_net_gbs:g} GB/s per node, {a.o_us:g} us per message; intra-node "
          f"{a.b_intra_gbs:g} GB/s; chunk {a.chunk_mib:g} MiB, {a.in_flight} in flight; "
          f"pipelined pieces 64 KiB")
    chunk = a.chunk_mib * MiB
    print(f"{'nodes':>6} {'GPUs':>6} | {'flat':>8} | {'hier, built':>11} | {'hier, pipelined':>15} | "
          f"{'step (pipelined)':>16} {'comm share':>10}")
    for n_nodes in node_counts:
        flat = allreduce_flat(grads, n_nodes, R, o, b_net, chunk)
        built = allreduce_hier_built(grads, n_nodes, R, o, b_net, b_intra, chunk, a.in_flight)
        piped = allreduce_hier_pipelined(grads, n_nodes, R, o, b_net, b_intra, chunk, 64 * 1024)
        step = t_compute + piped
        print(f"{n_nodes:>6} {n_nodes * R:>6} | {flat * 1e3:>5.1f} ms | {built * 1e3:>8.1f} ms | "
              f"{piped * 1e3:>12.1f} ms | {step * 1e3:>13.1f} ms {piped / step:>10.0%}")

    # Workload 2: checkpoints of a model with S bytes of state (parameters + AdamW's two
    # moments, float32: 12 bytes a parameter), every rank writing its share of the rows.
    print()
    print(f"# checkpoint: one shared file, every rank its rows; file system {a.fs_gbs:g} GB/s "
          f"aggregate, one file {a.file_gbs:.0f} GB/s, a node's client {a.node_io_gbs:g} GB/s, "
          f"commit {a.meta_s * 1e3:.0f} ms")
    sizes = [("deep MLP, 33.6 M params", 12 * 33.6e6), ("1.3 B params", 12 * 1.3e9),
             ("5 B params", 12 * 5e9)]
    print(f"{'nodes':>6} | " + " | ".join(f"{name + ' s':>24}" for name, _ in sizes)
          + f" | {'share per GPU (5 B)':>20}")
    for n_nodes in node_counts:
        cells = []
        for _, s in sizes:
            bw = min(n_nodes * a.node_io_gbs * GB, a.file_gbs * GB, a.fs_gbs * GB)
            cells.append(f"{a.meta_s + s / bw:>24.3f}")
        share = sizes[-1][1] / (n_nodes * R)
        print(f"{n_nodes:>6} | " + " | ".join(cells) + f" | {share / MB:>17.1f} MB")

    # Workload 3: ingest of a 10 TB CSV into a float32 dataset of about half its size.
    print()
    d_in, d_out = 10 * TB, 5 * TB
    rpn = a.ingest_ranks_per_node
    print(f"# ingest: {d_in / TB:g} TB of CSV -> {d_out / TB:g} TB float32, {rpn} ranks a node "
          f"at {a.parse_mbs:g} MB/s each; read from the file system, write one shared file")
    print(f"{'nodes':>6} | {'parse GB/s':>10} | {'read s':>8} | {'write s':>8} | {'total s':>8} | "
          f"bound")
    for n_nodes in node_counts:
        parse = n_nodes * rpn * a.parse_mbs * MB
        read_bw = min(parse, a.fs_gbs * GB, n_nodes * a.node_io_gbs * GB)
        write_bw = min(a.file_gbs * GB, n_nodes * a.node_io_gbs * GB)
        t_read, t_write = d_in / read_bw, d_out / write_bw
        bound = "parse" if parse <= min(a.fs_gbs * GB, n_nodes * a.node_io_gbs * GB) else "file system"
        print(f"{n_nodes:>6} | {parse / GB:>10.0f} | {t_read:>8.0f} | {t_write:>8.0f} | "
              f"{t_read + t_write:>8.0f} | read {bound}, write "
              f"{'one file' if write_bw == a.file_gbs * GB else 'node clients'}")


if __name__ == "__main__":
    main()
