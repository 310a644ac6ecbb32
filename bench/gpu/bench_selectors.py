"""The CUDA selectors on the tile16 shape at Lk = 16K, top-16: one figure per selector.

q [2, 4096, 16, 128] and k [2, 16384, 1, 128] bf16 of standard normal values; token_max reads index
vectors qidx [2, 4096, 1, 128] and kidx [2, 16384, 1, 128] of their own. Each selector writes TileLists
(idx [2, 1, 32, 16], cnt [2, 1, 32]) into tensors allocated once (out=), non-causal, the other options
the library's defaults. Before timing, every selector's lists are checked against the selector
contract (count, ascending distinct ids in range, -1 past the count, the forced / reserved block
present) and, on batch 0, against the same selector on the CPU (the float64 oracle): the GPU scores in
float32 on the tensor cores and may order near-ties (within the kernel's stated bound, docs/design.md
§5.7) differently, so the fraction of equal lists is reported and the mean share of the CPU's ids that
the GPU's lists hold must be at least MIN_OVERLAP (the GPU tests check the bound itself).

Usage: python3 bench_selectors.py [--json PATH] [--quick] [timing options, see --help]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
from harness import BLOCK, VerificationError  # noqa: E402

SHAPE = {"B": 2, "Lq": 4096, "Lk": 16384, "Hq": 16, "Hkv": 1, "D": 128, "top_k": 16}
# (name, call options, target in us where docs/design.md §8 sets one)
SELECTORS = [("pooled R1", {"representatives": 1}, 20.0), ("pooled R4", {"representatives": 4}, 25.0),
             ("token_max bf16", {"precision": "bf16"}, None), ("token_max fp8", {"precision": "fp8_e4m3"}, 45.0),
             ("token_max fp4", {"precision": "fp4_e2m1"}, None)]
MIN_OVERLAP = 0.9  # near-ties swap a few ids (fp8 accumulation the most); unrelated lists of 16 of 128 blocks share ~0.13


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_args(ap, peers=False)
    return harness.parse(ap, argv)


def select(sa, name, options, q, k, qidx, kidx, out):
    """One call of the named selector into out = (idx, cnt); q, k, qidx, kidx on one device."""
    top_k = SHAPE["top_k"]
    if name.startswith("pooled"):
        return sa.pooled_select(q, k, top_k=top_k, causal=False, out=out, **options)
    return sa.token_max_select(qidx, kidx, top_k=top_k, causal=False, format="tile", out=out, **options)


def id_overlap(got, want):
    """Mean over lists of the share of `want`'s ids (>= 0) that `got`'s list holds; int32 [..., K] each."""
    import torch
    g, w = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    hit = ((w[:, :, None] == g[:, None, :]).any(2) & (w >= 0)).sum(1).float()
    n = (w >= 0).sum(1).float()
    return float(torch.where(n > 0, hit / n.clamp(min=1), torch.ones_like(n)).mean())


def line(row):
    goal = f" (target <= {row['target_us']:.0f} us)" if row.get("target_us") else ""
    return (f"selector {row['selector']:15s} tile16 Lk={SHAPE['Lk']} top-{SHAPE['top_k']}: {row['us']:9.1f} us{goal}; "
            f"lists equal to the CPU selector's (batch 0): {row['equal_cpu_fraction']:.4f}, "
            f"ids shared: {row['cpu_id_overlap']:.4f}")


def run(args):
    torch, sa = harness.gpu_modules()
    gen = harness.generator(args.seed)
    timer = harness.Timer(args)
    res = harness.Results(args.json, harness.run_meta(args, shape=SHAPE, timer=timer.method))
    B, Lq, Lk, Hq, Hkv, D, top_k = (SHAPE[x] for x in ("B", "Lq", "Lk", "Hq", "Hkv", "D", "top_k"))
    q, k, _ = harness.random_qkv(B, Lq, Lk, Hq, Hkv, D, gen)
    qidx, kidx, _ = harness.random_qkv(B, Lq, Lk, Hkv, 1, D, gen)
    # The CPU selectors see the whole tensors (token_max's fp8 / fp4 scale is the amax of the whole tensor),
    # and their lists of batch 0 are compared.
    host = [x.cpu() for x in (q, k, qidx, kidx)]
    Tq = harness.ceil_div(Lq, BLOCK)
    out = (torch.empty(B, Hkv, Tq, top_k, dtype=torch.int32, device="cuda"),
           torch.empty(B, Hkv, Tq, dtype=torch.int32, device="cuda"))
    with res.recording_failure():
        for name, options, target in SELECTORS:
            out[0].fill_(-7)
            out[1].fill_(-7)
            select(sa, name, options, q, k, qidx, kidx, out)
            torch.cuda.synchronize()
            problems = harness.selector_list_problems(out[0].tolist(), out[1].tolist(), Lq, Lk, top_k, name)
            if problems:
                raise VerificationError(f"{name}: lists break the selector contract: " + "; ".join(problems))
            cpu_idx, cpu_cnt = (x[:1] for x in select(sa, name, options, *host, out=None))
            gpu_idx = out[0][:1].cpu()
            equal = ((gpu_idx == cpu_idx).all(dim=3) & (out[1][:1].cpu() == cpu_cnt)).float().mean().item()
            overlap = id_overlap(gpu_idx, cpu_idx)
            if overlap < MIN_OVERLAP:
                raise VerificationError(f"{name}: the GPU's lists hold {overlap:.4f} of the CPU selector's ids "
                                        f"(at least {MIN_OVERLAP} expected)")
            row = {"selector": name, "options": options, "us": 1e3 * timer(
                lambda: select(sa, name, options, q, k, qidx, kidx, out)), "equal_cpu_fraction": equal,
                   "cpu_id_overlap": overlap}
            if target is not None:
                row["target_us"] = target
            res.add(row, echo=False)
            print(line(row), flush=True)
    return res


def main(argv=None):
    return harness.exit_status(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
