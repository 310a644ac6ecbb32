"""Lightning indexer (token form) on the GPU against the fp8 matmul rate, in one process.

Shape: B = 1, Lq = Lk = L, 64 index heads, Di = 128, top-2048, causal; qI and kI bf16 (rounded through fp8
e4m3 with per-tensor scales by the selector for precision fp8_e4m3), w float32; sparse_attn.lightning_select
into TokenLists allocated once. FLOP rate = 2 * HI * Di * visible pairs / time; the fp8 matmul rate is
torch._scaled_mm on 8192^3, timed the same way. Before timing, the lists are checked: well formed on every
row, and on a few rows against the top-k of float64 scores recomputed here from the same fp8-rounded values
(the share of its ids held and the regret; the kernel may swap near-ties within its bound ε, docs/design.md
§5.7, which the GPU tests check).

Usage: python3 bench_lightning.py [--L 32768] [--json PATH] [--quick] [timing options, see --help]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
from harness import VerificationError  # noqa: E402


def fp8_values(x, scale):
    """The selector's fp8 rounding: x / scale rounded to e4m3 (nearest even, saturating), times the scale."""
    import torch
    y = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return y * scale


def check_lists(idx, L, top_k, causal):
    """Every row of TokenLists idx [1, 1, L, Kt]: min(top_k, visible keys) ascending ids in range, -1 after."""
    import torch
    rows = idx[0, 0]  # [L, Kt]
    t = torch.arange(L, device=idx.device)
    visible = (t + 1) if causal else torch.full_like(t, L)
    n = visible.clamp(max=top_k)
    slot = torch.arange(idx.shape[-1], device=idx.device)
    used = slot[None, :] < n[:, None]
    ok_pad = bool(((rows == -1) | used).all() and (rows[~used] == -1).all())
    ok_range = bool(((rows >= 0) & (rows < visible[:, None]))[used].all())
    asc = rows[:, 1:] > rows[:, :-1]
    ok_asc = bool((asc | ~used[:, 1:]).all())
    return ok_pad and ok_range and ok_asc


def check_rows(idx, q, w, k, rows, top_k, causal):
    """Spot rows against float64 scores recomputed here from the same fp8-rounded values: per row the share
    of the float64 top-k's ids the list holds, and the regret max(unselected) - min(selected) relative to the
    row's largest |score| (0 for an exact top-k; the kernel's bound ε allows a little). Returns the worst
    share and the worst regret."""
    import torch
    sq = q.abs().max().float() / 448.0
    sk = k.abs().max().float() / 448.0
    kv = fp8_values(k[0], sk).double()
    worst_share, worst_regret = 1.0, 0.0
    for t in rows:
        end = t + 1 if causal else k.shape[1]
        d = kv[:end] @ fp8_values(q[0, t], sq).double().T  # [end, HI]
        s = torch.relu(d) @ w[0, t].double()
        ref = torch.sort(s, descending=True, stable=True).indices[:min(top_k, end)]
        got = idx[0, 0, t][idx[0, 0, t] >= 0].long()
        share = torch.isin(ref, got).double().mean().item()
        chosen = torch.zeros(end, dtype=torch.bool, device=s.device)
        chosen[got] = True
        regret = 0.0
        if bool((~chosen).any()):
            regret = max(0.0, (s[~chosen].max() - s[chosen].min()).item()) / max(s.abs().max().item(), 1e-30)
        worst_share, worst_regret = min(worst_share, share), max(worst_regret, regret)
    return worst_share, worst_regret


MIN_SHARE, MAX_REGRET = 0.9, 2.0 ** -5  # loose: the GPU tests check the kernel's derived bound itself


def scaled_mm_rate(timer, n=8192):
    import torch
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0, device="cuda")
    ms = timer(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_args(ap, peers=False)
    ap.add_argument("--L", type=int, help="Lq = Lk (default 32768; 8192 with --quick)")
    args = harness.parse(ap, argv)
    if args.L is None:
        args.L = 8192 if args.quick else 32768
    if args.L < 2048:
        ap.error(f"--L must be at least the top-k, 2048, got {args.L}")
    return args


def run(args):
    torch, sa = harness.gpu_modules()
    gen = harness.generator(args.seed)
    timer = harness.Timer(args)
    B, L, HI, Di, top_k, causal = 1, args.L, 64, 128, 2048, True
    q = torch.randn(B, L, HI, Di, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(B, L, Di, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(B, L, HI, device="cuda", dtype=torch.float32, generator=gen)
    idx = torch.empty(B, 1, L, top_k, device="cuda", dtype=torch.int32)
    pairs = L * (L + 1) // 2 if causal else L * L
    flop = 2.0 * HI * Di * pairs * B
    fp8_rate = scaled_mm_rate(timer)
    res = harness.Results(args.json, harness.run_meta(
        args, timer=timer.method, shape={"B": B, "Lq": L, "Lk": L, "HI": HI, "Di": Di, "top_k": top_k,
                                         "causal": causal}, fp8_matmul_tflops=round(fp8_rate, 1)))
    call = lambda precision: sa.lightning_select(q, w, k, top_k=top_k, causal=causal, precision=precision, out=idx)
    with res.recording_failure():
        for precision in ("fp8_e4m3", "bf16"):
            idx.fill_(0x5a5a5a5a)
            call(precision)
            torch.cuda.synchronize()
            well_formed = check_lists(idx, L, top_k, causal)
            share, regret = check_rows(idx, q, w, k, [L - 1, L // 2, 3000, 2047, 2048], top_k, causal) \
                if precision == "fp8_e4m3" else (None, None)
            if not well_formed or (share is not None and (share < MIN_SHARE or regret > MAX_REGRET)):
                raise VerificationError(f"lightning {precision}: lists well formed {well_formed}, spot rows: share of "
                                        f"the float64 top-k {share}, relative regret {regret}")
            ms = timer(lambda: call(precision))
            tf = flop / (ms * 1e-3) / 1e12
            row = {"precision": precision, "ms": ms, "tflops": tf, "fraction_of_fp8_matmul": tf / fp8_rate,
                   "lists_well_formed": well_formed, "spot_rows_min_share": share, "spot_rows_max_regret": regret}
            res.add(row, echo=False)
            print(f"{precision}: {ms:.3f} ms, {tf:.1f} TFLOP/s = {tf / fp8_rate:.3f} x fp8 matmul ({fp8_rate:.0f}); "
                  f"well formed {well_formed}, spot rows: share {share}, regret {regret}", flush=True)


def main(argv=None):
    return harness.exit_status(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
