"""The Hopper Q-centric kernel (dense and tile_sparse) against its peers, in one process on one GPU.

Workloads (docs/design.md §7): tile16 (B=2, Hq=16, Hkv=1, D=128, Lq=4096, Lk 4K..64K, 16 blocks per Q tile,
patterns independent / pairs) and dense (B=2, Hq=Hkv=16, D=128 at L 4K / 16K and D=64 at 4K, causal and
not). Ours: sparse_attn.tile_sparse with the lists trusted (the selector produced them) and validated
(the default call), sparse_attn.dense. Peers (bench/harness.py): FlexAttention, FA4 and FlashInfer on
the same lists; SDPA cuDNN and flash, and FA4, dense. Every output is checked against a float64
reference on sampled rows before it is timed (a failure of ours stops the run; a peer's is reported),
and each peer's output against ours on the whole tensor (relerr_vs_<peer>).

Usage: python3 bench_attention.py [--json PATH] [--quick] [--no-peers] [timing options, see --help]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
from harness import BLOCK  # noqa: E402

TILE16 = {"B": 2, "Hq": 16, "Hkv": 1, "D": 128, "Lq": 4096, "nsel": 16}
TILE16_LK = [4096, 8192, 16384, 32768, 65536]
TILE16_LK_QUICK = [4096, 16384, 65536]
DENSE = [(128, 4096), (128, 16384), (64, 4096)]  # (D, L) at B=2, Hq=Hkv=16


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_args(ap)
    return harness.parse(ap, argv)


def measure_peers(row, makes, ours_out, q, k, v, idx, cnt, causal, timer, gen, flop):
    """Verifies and times each peer; a peer that fails or refuses the shape is reported in the row."""
    for name, make in makes:
        try:
            run = make()
            out = run()
            check = harness.verify_tile_output(out, q, k, v, idx, cnt, causal, gen, name)
            row[f"relerr_vs_{name}"] = harness.relerr(ours_out, out)
            row[f"{name}_check_relerr"] = check["relerr"]
            row[f"{name}_ms"] = timer(run)
            row[f"{name}_tflops"] = harness.tflops(flop, row[f"{name}_ms"])
        except Exception as e:  # a peer's failure is reported, not fatal
            row[f"{name}_error"] = harness.short_error(e)


def run(args):
    harness.run_measurement(args, measure, table)


def measure(args, res, timer, peers, gen, cpu_gen):
    import torch
    import sparse_attn

    B, Hq, Hkv, D, Lq, nsel = (TILE16[x] for x in ("B", "Hq", "Hkv", "D", "Lq", "nsel"))
    for Lk in (TILE16_LK_QUICK if args.quick else TILE16_LK):
        q, k, v = harness.random_qkv(B, Lq, Lk, Hq, Hkv, D, gen)
        out = torch.empty_like(q)
        for pattern in ("independent", "pairs"):
            idx, cnt = harness.tile_lists(B, Hkv, Lq // BLOCK, Lk // BLOCK, nsel, pattern, gen)
            call = lambda trusted: sparse_attn.tile_sparse(q, k, v, idx, cnt, out=out, trusted=trusted)
            check = harness.verify_tile_output(harness.poisoned(lambda: call(False), out), q, k, v, idx, cnt, False,
                                               cpu_gen, f"tile_sparse {pattern} Lk={Lk}")
            flop = 4 * D * B * Hq * (Lq // BLOCK) * nsel * BLOCK * BLOCK
            row = {"workload": "tile16", "pattern": pattern, "Lk": Lk, "B": B, "Hq": Hq, "Hkv": Hkv, "Lq": Lq, "D": D,
                   "useful_gflop": flop / 1e9, "check_relerr": check["relerr"]}
            row["ours_ms"] = timer(lambda: call(True))
            row["ours_tflops"] = harness.tflops(flop, row["ours_ms"])
            row["ours_validated_ms"] = timer(lambda: call(False))
            measure_peers(row, peers.tile(q, k, v, idx, cnt), out.clone(), q, k, v, idx, cnt, False, timer, cpu_gen,
                          flop)
            res.add(row)

    B, Hq, Hkv = 2, 16, 16
    for D, L in DENSE:
        q, k, v = harness.random_qkv(B, L, L, Hq, Hkv, D, gen)
        out = torch.empty_like(q)
        for causal in (False, True):
            call = lambda: sparse_attn.dense(q, k, v, causal=causal, out=out)
            check = harness.verify_tile_output(harness.poisoned(call, out), q, k, v, None, None, causal, cpu_gen,
                                               f"dense D={D} L={L} causal={causal}")
            flop = 4 * D * harness.dense_pairs(B, Hq, L, L, causal)
            row = {"workload": "dense" if D == 128 else "dense64", "causal": causal, "L": L, "B": B, "Hq": Hq,
                   "Hkv": Hkv, "D": D, "useful_gflop": flop / 1e9, "check_relerr": check["relerr"]}
            row["ours_ms"] = timer(call)
            row["ours_tflops"] = harness.tflops(flop, row["ours_ms"])
            measure_peers(row, peers.dense(q, k, v, causal), out.clone(), q, k, v, None, None, causal, timer, cpu_gen,
                          flop)
            res.add(row)


def table(rows):
    """The short table printed last: useful TFLOP/s of ours and of each peer measured."""
    peers = [p for p in ("flex", "fa4", "flashinfer", "cudnn", "flash") if any(f"{p}_tflops" in r for r in rows)]
    fmt = lambda x: "%8.1f" % x if isinstance(x, float) else "%8s" % "-"
    lines = ["%-8s %-12s %6s | %9s %8s | %s" % ("work", "variant", "L", "ours ms", "TFLOP/s",
                                                " ".join("%8s" % p for p in peers))]
    for r in rows:
        var = r["pattern"] if r["workload"] == "tile16" else ("causal" if r["causal"] else "full")
        L = r["Lk"] if r["workload"] == "tile16" else r["L"]
        lines.append("%-8s %-12s %6d | %9.3f %8.1f | %s" % (r["workload"], var, L, r["ours_ms"], r["ours_tflops"],
                                                           " ".join(fmt(r.get(f"{p}_tflops")) for p in peers)))
    return "\n".join(lines)


def main(argv=None):
    return harness.exit_status(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
