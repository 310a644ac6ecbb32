"""Per-block and per-unit cost of the Q-centric kernel, for timing a change against its parent.

tile16's shape (B 2, Hq 16, Hkv 1, D 128, Lq 4K, Lk 16K) with n = 4, 8, 16, 32, 64 blocks per Q tile
through sparse_attn.tile_sparse (trusted), where the launcher's cost model walks every unit whole (1024
units on 132 CTAs: the busiest CTA runs 8). Each time is the median of --samples samples of 10
back-to-back launches, the n interleaved sample by sample so the card's drift falls on all alike; the fit
t / 8 = a n + b gives a (us per block: the main loop) and b (us per unit: the item boundary, the epilogue
and the launch's share). Two builds of the library cannot share a process: run one process per build,
alternating builds, several rounds (docs/notes/hopper.md, "Where an item boundary goes").

Usage: python3 dev/bench/unit_cost.py --json result.json [--samples 20]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import harness  # noqa: E402
from harness import BLOCK  # noqa: E402

NS = [4, 8, 16, 32, 64]
UNITS_PER_CTA = 8  # 1024 units on 132 CTAs: the busiest runs 8
SHAPE = {"B": 2, "Hq": 16, "Hkv": 1, "D": 128, "Lq": 4096, "Lk": 16384}


def sample(fn, calls=10):
    """Mean time (ms) of `calls` back-to-back launches between two CUDA events."""
    import torch
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / calls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args(argv)
    if args.samples < 1:
        ap.error(f"--samples must be >= 1, got {args.samples}")
    torch, sa = harness.gpu_modules()
    gen = harness.generator(args.seed)
    cpu_gen = torch.Generator().manual_seed(args.seed)
    B, Hq, Hkv, D, Lq, Lk = (SHAPE[x] for x in ("B", "Hq", "Hkv", "D", "Lq", "Lk"))
    q, k, v = harness.random_qkv(B, Lq, Lk, Hq, Hkv, D, gen)
    calls = {}
    for n in NS:
        idx, cnt = harness.tile_lists(B, Hkv, Lq // BLOCK, Lk // BLOCK, n, "independent", gen)
        out = torch.empty_like(q)
        call = (lambda idx, cnt, out: lambda trusted=True: sa.tile_sparse(q, k, v, idx, cnt, out=out,
                                                                          trusted=trusted))(idx, cnt, out)
        harness.verify_tile_output(harness.poisoned(lambda: call(False), out), q, k, v, idx, cnt, False, cpu_gen,
                                   f"n = {n}")
        calls[n] = call
    for call in calls.values():
        for _ in range(3):
            call()
    times = {n: [] for n in NS}
    for _ in range(args.samples):
        for n, call in calls.items():
            times[n].append(sample(call))
    med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    ys = [med[n] * 1000 / UNITS_PER_CTA for n in NS]
    mx, my = sum(NS) / len(NS), sum(ys) / len(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(NS, ys)) / sum((x - mx) ** 2 for x in NS)
    b = my - a * mx
    harness.write_json(args.json, {"meta": harness.run_meta(shape=SHAPE, samples=args.samples),
                                   "median_ms": {str(n): med[n] for n in NS},
                                   "fit": {"us_per_block": a, "us_per_unit": b}})
    for n in NS:
        flop = 4 * D * B * Hq * (Lq // BLOCK) * n * BLOCK * BLOCK
        print("n = %3d  %.4f ms  %6.1f TFLOP/s" % (n, med[n], harness.tflops(flop, med[n])))
    print("fit: %.3f us per block + %.2f us per unit" % (a, b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
