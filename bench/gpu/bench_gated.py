"""gated (BSFA, docs/design.md §5.5) on the Hopper kernel against dense causal attention (ours and
cuDNN SDPA), in one process on one GPU.

Shape: B=1, Hq=32, Hkv=8, D=128, causal, L in {8K, 32K, 64K} (--quick: 8K, 32K); target block
densities {1.0, 0.7, 0.5, 0.36, 0.2}. Thresholds are quantiles of the maxima of sampled candidate
blocks of the benchmarked input itself (one threshold for every head and gate tile): density 1.0 is
the open gate (-inf). The density reached is the kernel's own count (kept / visible blocks). Every
gated output is checked before it is timed on sampled rows against a float64 reference over the
blocks a float64 gate keeps (blocks within 1e-3 of the threshold decided by the kernel's count per
gate tile); dense causal is checked as in bench_attention.py, cuDNN's output against ours.

Usage: python3 bench_gated.py [--json PATH] [--quick] [--no-peers] [timing options, see --help]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402

SHAPE = {"B": 1, "Hq": 32, "Hkv": 8, "D": 128}
LENGTHS = [8192, 32768, 65536]
LENGTHS_QUICK = [8192, 32768]
DENSITIES = [1.0, 0.7, 0.5, 0.36, 0.2]
GATE_ROWS = 64
SINKS = 1  # sparse_attn.gated's default
SAMPLED_BLOCKS = 4096
AMBIGUITY = 1e-3


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_args(ap)
    return harness.parse(ap, argv)


def gate_geometry(L):
    """Per gate tile g: (n_visible, n_forced, first candidate, end of candidates) for Lq = Lk = L."""
    Tg, Tk = harness.ceil_div(L, GATE_ROWS), harness.ceil_div(L, harness.BLOCK)
    out = []
    for g in range(Tg):
        last = min(L, (g + 1) * GATE_ROWS) - 1
        visible = min(Tk, last // harness.BLOCK + 1)
        end = SINKS
        while end < Tk and min(L, (end + 1) * harness.BLOCK) - 1 <= g * GATE_ROWS:
            end += 1
        n_cand = max(0, end - SINKS)
        out.append((visible, visible - n_cand, SINKS, end))
    return out


def block_maxima(q, k, b, h, g, js, scale):
    """Maxima of the scaled scores of gate tile g and blocks js of head h (fully visible blocks), in
    float32 for 16-bit inputs and float64 for float64 ones."""
    import torch
    L, group = q.shape[1], q.shape[2] // k.shape[2]
    dt = torch.promote_types(q.dtype, torch.float32)
    rows = q[b, g * GATE_ROWS:min(L, (g + 1) * GATE_ROWS), h].to(dt)
    keys = torch.stack([k[b, j * harness.BLOCK:(j + 1) * harness.BLOCK, h // group].to(dt) for j in js])
    return (torch.einsum("rd,jkd->jrk", rows, keys) * scale).amax(dim=(1, 2))


def thresholds_for(q, k, geometry, densities, gen, scale):
    """One threshold per density: the quantile of sampled candidate maxima that keeps the target."""
    import torch
    cands = [(g, j) for g, (_, _, lo, hi) in enumerate(geometry) for j in range(lo, hi)]
    visible = sum(v for v, _, _, _ in geometry)
    forced = sum(f for _, f, _, _ in geometry)
    picks = torch.randint(len(cands), (min(SAMPLED_BLOCKS, len(cands)),), generator=gen).tolist()
    heads = torch.randint(q.shape[2], (len(picks),), generator=gen).tolist()
    maxima = torch.stack([block_maxima(q, k, 0, h, cands[p][0], [cands[p][1]], scale)[0] for p, h in zip(picks, heads)])
    maxima = maxima.sort().values.cpu()
    out = {}
    for d in densities:
        passing = (d * visible - forced) / max(1, len(cands))
        if passing >= 1.0:
            out[d] = float("-inf")
        elif passing <= 0.0:
            out[d] = float(maxima[-1]) + 1e3
        else:
            out[d] = float(maxima[min(len(maxima) - 1, int((1.0 - passing) * len(maxima)))])
    return out


def gate_keymask(q, k, t, geometry, scale, kept):
    """keymask(b, h, rows) of the blocks the gate keeps, decided in float64; where a candidate's
    maximum lies within AMBIGUITY of t, the kernel's count of kept blocks for the gate tile (kept
    [B, Hq, Tg]) says how many of those went through, and they are the largest ones. A count that no
    such assignment explains fails the check."""
    import torch
    L = q.shape[1]
    qd, kd = q.double(), k.double()
    cache = {}

    def blocks_kept(b, h, g):
        if (b, h, g) in cache:
            return cache[(b, h, g)]
        visible, forced, lo, hi = geometry[g]
        keep = torch.ones(visible, dtype=torch.bool)
        if hi > lo and t != float("-inf"):
            m = block_maxima(qd, kd, b, h, g, list(range(lo, hi)), scale).cpu()
            near = (m - t).abs() < AMBIGUITY
            clear = (m >= t) & ~near
            extra = int(kept[b, h, g]) - forced - int(clear.sum())
            if not 0 <= extra <= int(near.sum()):
                raise harness.VerificationError(
                    f"gated: gate tile {g} of head {h} kept {int(kept[b, h, g])} blocks; the float64 gate "
                    f"keeps {forced + int(clear.sum())} plus up to {int(near.sum())} within {AMBIGUITY} of {t}")
            order = torch.where(near, m, torch.full_like(m, -float("inf"))).argsort(descending=True)
            clear[order[:extra]] = True
            keep[lo:hi] = clear
        cache[(b, h, g)] = keep
        return keep

    def keymask(b, h, rows):
        mask = torch.zeros(len(rows), L, dtype=torch.bool)
        for n, i in enumerate(rows.tolist()):
            keep = blocks_kept(b, h, i // GATE_ROWS).repeat_interleave(harness.BLOCK)[:L]
            mask[n, :len(keep)] = keep
            mask[n, i + 1:] = False
        return mask
    return keymask


def run(args):
    harness.run_measurement(args, measure, table)


def measure(args, res, timer, peers, gen, cpu_gen):
    import torch
    import sparse_attn
    import sparse_attn.torch as sat

    B, Hq, Hkv, D = (SHAPE[x] for x in ("B", "Hq", "Hkv", "D"))
    scale = D ** -0.5
    for L in (LENGTHS_QUICK if args.quick else LENGTHS):
        q, k, v = harness.random_qkv(B, L, L, Hq, Hkv, D, gen)
        out = torch.empty_like(q)
        flop_dense = 4 * D * harness.dense_pairs(B, Hq, L, L, True)
        call = lambda: sparse_attn.dense(q, k, v, causal=True, out=out)
        check = harness.verify_tile_output(harness.poisoned(call, out), q, k, v, None, None, True, cpu_gen,
                                           f"dense causal L={L}")
        row = {"case": "dense causal", "L": L, **SHAPE, "useful_gflop": flop_dense / 1e9, "check_relerr": check["relerr"]}
        row["ours_ms"] = timer(call)
        dense_ms = row["ours_ms"]
        row["ours_tflops"] = harness.tflops(flop_dense, dense_ms)
        for name, make in peers.dense(q, k, v, True):
            try:
                run_peer = make()
                row[f"relerr_vs_{name}"] = harness.relerr(out, run_peer())
                row[f"{name}_ms"] = timer(run_peer)
                row[f"{name}_tflops"] = harness.tflops(flop_dense, row[f"{name}_ms"])
            except Exception as e:  # a peer's failure is reported, not fatal
                row[f"{name}_error"] = harness.short_error(e)
        res.add(row)
        cudnn_ms = row.get("cudnn_ms")

        geometry = gate_geometry(L)
        thresholds = thresholds_for(q, k, geometry, DENSITIES, cpu_gen, scale)
        for d in DENSITIES:
            t = thresholds[d]
            thr = torch.full((Hq, 1), t, device=q.device)
            call = lambda: sat.gated(q, k, v, thr, stats=False)[0]
            got, stats = sat.gated(q, k, v, thr, return_kept_per_tile=True)
            kept = stats["kept_per_tile"].cpu()
            check = harness.verify_rows(got, q, k, v, gate_keymask(q, k, t, geometry, scale, kept), cpu_gen)
            if not check["ok"]:
                raise harness.VerificationError(f"gated L={L} density {d}: against the float64 reference {check}")
            row = {"case": "gated", "L": L, **SHAPE, "target_density": d, "threshold": t,
                   "density": stats["density"], "stats": {n: stats[n] for n in sparse_attn._GATED_COUNTS},
                   "check_relerr": check["relerr"]}
            row["ours_ms"] = timer(call)
            row["speedup_vs_dense"] = dense_ms / row["ours_ms"]
            if cudnn_ms:
                row["speedup_vs_cudnn"] = cudnn_ms / row["ours_ms"]
            # Useful work: dense causal scaled by the kept fraction of blocks (an estimate: the
            # diagonal blocks are half visible).
            row["ours_tflops"] = harness.tflops(flop_dense * stats["density"], row["ours_ms"])
            res.add(row)


def table(rows):
    fmt = lambda x: "%8.3f" % x if isinstance(x, float) else "%8s" % "-"
    lines = ["%-13s %6s %7s %7s | %9s %8s %8s" % ("case", "L", "target", "density", "ms", "x dense", "x cudnn")]
    for r in rows:
        lines.append("%-13s %6d %7s %7s | %9.3f %8s %8s" % (
            r["case"], r["L"], fmt(r.get("target_density")), fmt(r.get("density")), r["ours_ms"],
            fmt(r.get("speedup_vs_dense")), fmt(r.get("speedup_vs_cudnn"))))
    return "\n".join(lines)


def main(argv=None):
    return harness.exit_status(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
