"""Context-parallel prefill across GPUs: sparse_attn.distributed against dense ring attention.

Issue 28 / docs/design.md §5.10. Launched by torchrun, one process per GPU (NCCL), or with --device cpu
on gloo for a small check of the whole script without a GPU. Every rank builds the same global bf16
inputs from the seed (B=1, Hq=32, Hkv=8, D=128, causal by default) and keeps its own rows. For each
length (--len, default 128K and 256K) and workload:
  dense   sparse_attn.distributed.dense, and the peer: ring attention built from torch.distributed P2P
          (batch_isend_irecv of the K/V shard to the next rank while this step computes) with the cuDNN
          SDPA kernel per step (torch.ops.aten._scaled_dot_product_cudnn_attention, K/V repeated to Hq
          for it; on the CPU the flash SDPA for CPU), zig-zag shards of 2R chunks, partial outputs
          merged in float32 by their LSE;
  sparse  sparse_attn.distributed.tile_sparse on random causal TileLists holding --density of each
          tile's visible blocks (its diagonal block always), one list per KV head.
Rows (rank 0 writes them): time per call (the slowest rank's wall time between a barrier and the
device's completion, median of --reps), the same operator on the whole problem on one device (rank 0
alone, same timing), scaling efficiency = one-device time / (R x R-rank time), useful TFLOP/s,
bytes sent and received per rank (the library's: as its collectives carried them, with the plan's
figures for both strategies; the ring's: (R - 1) K/V shards), balance = max / mean of per-rank work
(the plan's block-level figure; the ring's exact pair counts per rank), strategy and layout.
Every output is gathered and checked on sampled rows against a float64 reference (bench/harness.py,
verify_rows) before anything is timed.

Usage: torchrun --nproc_per_node N bench_distributed.py [--len 131072,262144] [--workloads dense,sparse]
                [--density 0.25] [--strategy auto|kv|partials] [--json PATH] [--quick] [--no-peers]
                [--no-single] [--reps N]
       torchrun --nproc_per_node 2 bench_distributed.py --device cpu --len 1024   (gloo, no GPU)
"""
import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
from harness import BLOCK  # noqa: E402

WORKLOADS = ("dense", "sparse")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_args(p)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: NCCL, one GPU per process; cpu: gloo on CPU tensors (a check, not a benchmark)")
    p.add_argument("--len", default="131072,262144", help="sequence lengths, comma-separated")
    p.add_argument("--workloads", default="dense,sparse", help="comma-separated: dense, sparse")
    p.add_argument("--density", type=float, default=0.25, help="sparse: fraction of each tile's visible blocks")
    p.add_argument("--heads", default="32,8", help="Hq,Hkv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--strategy", choices=("auto", "kv", "partials"), default="auto")
    p.add_argument("--reps", type=int, help="timed calls per figure (default 10, 3 with --quick)")
    p.add_argument("--no-single", action="store_true", help="skip the one-device figures (and the efficiency)")
    p.add_argument("--ring-sdpa", choices=("cudnn", "flash"), default="cudnn",
                   help="the SDPA kernel of the ring peer's steps on the GPU (its LSE merges the steps)")
    args = p.parse_args(argv)
    harness.finish_args(p, args)
    try:
        args.lens = [int(x) for x in args.len.split(",")]
        args.hq, args.hkv = (int(x) for x in args.heads.split(","))
    except ValueError:
        p.error(f"--len and --heads take comma-separated integers, got {args.len!r}, {args.heads!r}")
    args.workloads = args.workloads.split(",")
    if any(w not in WORKLOADS for w in args.workloads):
        p.error(f"--workloads: unknown {args.workloads}, expected some of {','.join(WORKLOADS)}")
    if not 0 < args.density <= 1:
        p.error(f"--density must be in (0, 1], got {args.density}")
    if args.hq % args.hkv:
        p.error(f"--heads: Hq must be a multiple of Hkv, got {args.heads}")
    args.reps = args.reps or (3 if args.quick else 10)
    return args


# ---- inputs -----------------------------------------------------------------------------------------

def causal_lists(B, G, L, density, gen, causal):
    """TileLists holding ceil(density * visible) random visible blocks of each tile, its diagonal
    block always among them, ascending."""
    import torch
    Tq = harness.ceil_div(L, BLOCK)
    dev = gen.device
    t = torch.arange(Tq, device=dev)
    visible = t[:, None] >= t[None, :] if causal else torch.ones(Tq, Tq, dtype=torch.bool, device=dev)
    score = torch.rand(B, G, Tq, Tq, device=dev, generator=gen).masked_fill(~visible, -1.0)
    score[..., t, t] = 2.0
    n = torch.clamp((visible.sum(1).double() * density).ceil().long(), min=1)
    kmax = int(n.max())
    top = score.topk(kmax, dim=3).indices
    keep = torch.arange(kmax, device=dev) < n[:, None]
    idx = torch.where(keep, top, torch.full_like(top, Tq)).sort(dim=3).values
    idx = torch.where(idx == Tq, torch.full_like(idx, -1), idx).to(torch.int32).contiguous()
    return idx, n.to(torch.int32).expand(B, G, Tq).contiguous()


def sparse_pairs(idx, cnt, L, Hq, causal):
    """Visible (query head, query, key) triples of TileLists (numpy on the host)."""
    import numpy as np
    idx, cnt = idx.cpu().numpy(), cnt.cpu().numpy()
    G, Tq = idx.shape[1], idx.shape[2]
    rows = np.minimum(BLOCK, L - BLOCK * np.arange(Tq))
    b, g, t, s = np.nonzero(np.arange(idx.shape[3]) < cnt[..., None])
    j = idx[b, g, t, s]
    keys = np.minimum(BLOCK, L - BLOCK * j)
    pairs = rows[t] * keys
    if causal:
        pairs = np.where(j < t, pairs, np.where(j == t, rows[t] * (rows[t] + 1) // 2, 0))
    return int(pairs.sum()) * (Hq // G)


# ---- the peer: ring attention ---------------------------------------------------------------------

def _sdpa_lse(q, k, v, causal, kernel="cudnn"):
    """(out float32 [B, H, L, D], lse [B, H, L]) of one SDPA call on (B, H, L, D) tensors with K/V at
    Hq heads: on the GPU the cuDNN kernel (or with kernel="flash" the flash one), on the CPU the flash
    kernel for CPU."""
    import torch
    if q.device.type != "cuda":
        r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    elif kernel == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
    else:
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    return r[0].float(), r[1].reshape(q.shape[:3]).float()


def ring_shard(x, rank, world):
    """Rows of chunks rank and 2R - 1 - rank of 2R equal chunks (zig-zag)."""
    import torch
    c = x.shape[1] // (2 * world)
    return torch.cat((x[:, rank * c:(rank + 1) * c], x[:, (2 * world - 1 - rank) * c:(2 * world - rank) * c]), dim=1)


def ring_unshard(parts):
    import torch
    R = len(parts)
    halves = [p.chunk(2, dim=1) for p in parts]
    return torch.cat([halves[r][0] for r in range(R)] + [halves[R - 1 - r][1] for r in range(R)], dim=1)


def ring_attention(q, k, v, causal, kernel="cudnn", group=None):
    """Dense attention of the zig-zag shard q [B, 2c, Hq, D] over the whole sequence: the K/V shards
    travel around the ring (step s holds rank r - s's), each step one SDPA call on the rows and keys
    that see each other, merged by LSE in float32. Returns out [B, 2c, Hq, D] in q's dtype."""
    import torch
    import torch.distributed as dist
    R, r = dist.get_world_size(group), dist.get_rank(group)
    rep = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    c = q.shape[1] // 2
    out = torch.zeros(qt.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(qt.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)

    def merge(rows, o, l):
        new = torch.logaddexp(lse[:, :, rows], l)
        keep, add = torch.exp(lse[:, :, rows] - new), torch.exp(l - new)
        out[:, :, rows] = out[:, :, rows] * keep[..., None] + o * add[..., None]
        lse[:, :, rows] = new

    kv = torch.stack((k, v)).contiguous()
    for step in range(R):
        reqs = []
        if step < R - 1:
            nxt = torch.empty_like(kv)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % R, group),
                                           dist.P2POp(dist.irecv, nxt, (r - 1) % R, group)])
        src = (r - step) % R
        kt, vt = (x.transpose(1, 2).repeat_interleave(rep, dim=1) for x in kv)
        if not causal:
            merge(slice(None), *_sdpa_lse(qt, kt, vt, False, kernel))
        elif step == 0:
            merge(slice(None), *_sdpa_lse(qt, kt, vt, True, kernel))
        elif src < r:   # its first chunk precedes both of ours, its second follows both
            merge(slice(None), *_sdpa_lse(qt, kt[:, :, :c], vt[:, :, :c], False, kernel))
        else:           # both of its chunks precede our second one and follow our first
            merge(slice(c, None), *_sdpa_lse(qt[:, :, c:], kt, vt, False, kernel))
        for req in reqs:
            req.wait()
        if step < R - 1:
            kv = nxt
    return out.transpose(1, 2).to(q.dtype)


def ring_work(L, world, causal):
    """Visible (query, key) pairs of each rank's zig-zag rows."""
    c = L // (2 * world)
    rows = lambda a: sum(i + 1 for i in range(a * c, (a + 1) * c)) if causal else c * L  # noqa: E731
    return [rows(r) + rows(2 * world - 1 - r) for r in range(world)]


# ---- timing -----------------------------------------------------------------------------------------

def _sync(device):
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def _on_backend(values, dtype):
    """A tensor of values where the process group's collectives take it (NCCL: the current GPU)."""
    import torch
    import torch.distributed as dist
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    return torch.tensor(values, dtype=dtype, device=dev)


def time_all_ranks(fn, reps, device, warmup=1):
    """Median over reps of the slowest rank's time (ms) from a barrier to the device's completion."""
    import torch
    import torch.distributed as dist
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = _on_backend([time.perf_counter() - t0], torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item() * 1e3)
    return statistics.median(times)


def time_rank0(fn, reps, device):
    """The same timing of fn on rank 0 alone (the other ranks wait); the figure on every rank."""
    import torch
    import torch.distributed as dist
    ms = _on_backend([0.0], torch.float64)
    if dist.get_rank() == 0:
        fn()
        times = []
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        ms[0] = statistics.median(times)
    dist.broadcast(ms, 0)
    return ms.item()


# ---- the run ----------------------------------------------------------------------------------------

def run(args):
    import torch
    import torch.distributed as dist

    import sparse_attn as sa
    import sparse_attn.distributed as sd

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA device (torch.cuda.is_available() is False)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        _run(args, torch, dist, sa, sd)
    finally:
        dist.destroy_process_group()


def _run(args, torch, dist, sa, sd):
    rank, R = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16
    causal = not args.non_causal
    B, Hq, Hkv, D = args.batch, args.hq, args.hkv, args.head_dim
    results = harness.Results(args.json if rank == 0 else None,
                              harness.run_meta(args, world_size=R, backend=dist.get_backend(), device_kind=args.device))
    verify_gen = torch.Generator().manual_seed(args.seed)

    def add(row):
        if rank == 0:
            results.add(row)

    def checked(verify):
        """verify() on rank 0; every rank raises VerificationError if it failed (none is left waiting
        in a collective)."""
        result, error = None, None
        if rank == 0:
            try:
                result = verify()
            except harness.VerificationError as e:
                error = e
        flag = _on_backend([error is None], torch.int64)
        dist.broadcast(flag, 0)
        if not flag.item():
            raise error or harness.VerificationError("rank 0's verification failed")
        return result

    with results.recording_failure():
        for L in args.lens:
            if L % (2 * R * BLOCK):
                raise SystemExit(f"--len {L}: must be a multiple of 2 * world_size * {BLOCK} (zig-zag chunks)")
            gen = harness.generator(args.seed + L, device=device.type)
            q, k, v = harness.random_qkv(B, L, L, Hq, Hkv, D, gen, dtype)
            shape = sa.ProblemShape(B, L, L, Hq, Hkv, D, causal)
            base = {"L": L, "B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "causal": causal, "world_size": R}
            for workload in args.workloads:
                sel, sel_kw = (), {}
                if workload == "sparse":
                    idx, cnt = causal_lists(B, Hkv, L, args.density, gen, causal)
                    sel, sel_kw = (idx, cnt), {"tiles": (idx, cnt)}
                    pairs = sparse_pairs(idx, cnt, L, Hq, causal)
                else:
                    pairs = harness.dense_pairs(B, Hq, L, L, causal)
                flop = 4 * D * pairs
                plan = sd.plan(shape, R, dtype=dtype, strategy=args.strategy, **sel_kw)
                ql, kl, vl = (plan.shard(x, rank) for x in (q, k, v))
                op = sd.dense if workload == "dense" else sd.tile_sparse
                one = sa.dense if workload == "dense" else sa.tile_sparse

                out, stats = op(ql, kl, vl, *sel, plan, return_stats=True)
                full = sd.gather(out, plan)
                check = checked(lambda: harness.verify_tile_output(
                    full, q, k, v, *(sel or (None, None)), causal, verify_gen, f"distributed {workload} L={L}"))
                del full
                ms = time_all_ranks(lambda: op(ql, kl, vl, *sel, plan), args.reps, args.device)
                ms1 = None if args.no_single else time_rank0(
                    lambda: one(q, k, v, *sel, causal=causal), args.reps, args.device)
                counts = _on_backend([stats["bytes_sent"], stats["bytes_received"]], torch.int64)
                every = [torch.zeros_like(counts) for _ in range(R)]
                dist.all_gather(every, counts)
                sent, received = [int(c[0]) for c in every], [int(c[1]) for c in every]
                add({**base, "workload": workload, "impl": "sparse_attn", "density": args.density if sel else 1.0,
                     "ms": ms, "ms_one_device": ms1,
                     "scaling_efficiency": ms1 / (R * ms) if ms1 else None,
                     "useful_tflops": harness.tflops(flop, ms), "bytes_sent": sent, "bytes_received": received,
                     "balance": plan.balance, "plan": plan.summary(), "verify": check})
                del ql, kl, vl, out

                if workload == "dense" and not args.no_peers:
                    qr, kr, vr = (ring_shard(x, rank, R) for x in (q, k, v))
                    out = ring_attention(qr, kr, vr, causal, args.ring_sdpa)
                    parts = [torch.empty_like(out) for _ in range(R)]
                    dist.all_gather(parts, out)
                    check = checked(lambda: harness.verify_tile_output(
                        ring_unshard(parts), q, k, v, None, None, causal, verify_gen, f"ring attention L={L}"))
                    del parts
                    ms = time_all_ranks(lambda: ring_attention(qr, kr, vr, causal, args.ring_sdpa), args.reps,
                                        args.device)
                    ms1 = None
                    if not args.no_single:  # one SDPA call on the whole problem, K/V repeated beforehand
                        qkv = tuple(x.transpose(1, 2).repeat_interleave(Hq // x.shape[2], 1) for x in (q, k, v))
                        ms1 = time_rank0(lambda: _sdpa_lse(*qkv, causal, args.ring_sdpa), args.reps, args.device)
                        del qkv
                    shard_bytes = kr.numel() * kr.element_size() * 2
                    work = ring_work(L, R, causal)
                    impl = "ring_sdpa_" + (args.ring_sdpa if args.device == "cuda" else "cpu")
                    add({**base, "workload": workload, "impl": impl, "density": 1.0, "ms": ms, "ms_one_device": ms1,
                         "scaling_efficiency": ms1 / (R * ms) if ms1 else None,
                         "useful_tflops": harness.tflops(flop, ms), "bytes_sent": [(R - 1) * shard_bytes] * R,
                         "bytes_received": [(R - 1) * shard_bytes] * R,
                         "balance": max(work) / (sum(work) / R), "verify": check})
                    del qr, kr, vr, out
            del q, k, v


def main(argv=None):
    return harness.exit_status(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
