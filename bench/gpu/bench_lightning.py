"""Lightning indexer (token form) on the GPU against the fp8 matmul rate, in one process.

Usage: python3 bench_lightning.py LIBRARY [--L 32768] [--iters 5] [--json PATH]
LIBRARY is a shared library exporting sa_bench_lightning_tokens (bench/gpu/capi_lightning.cpp).
Shape: B = 1, Lq = Lk = L, 64 index heads, Di = 128, top-2048, causal; qI and kI bf16 (rounded through fp8 e4m3
with per-tensor scales by the selector), w float32. FLOP rate = 2 * HI * Di * visible pairs / time. Before
timing, the lists are checked: well formed on every row, and on a few rows equal to the top-k of float64 scores
recomputed here from the same fp8-rounded values (differences allowed only between keys whose float64 scores
tie the k-th to 1e-12 relative, where the summation order of this check and the library's differ).
"""
import argparse
import ctypes
import json
import sys
import time

import torch


def load(path):
    lib = ctypes.CDLL(path)
    f = lib.sa_bench_lightning_tokens
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_void_p] + [ctypes.c_int64] * 7 + [ctypes.c_int] * 3 + \
        [ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_char_p, ctypes.c_int]
    return f


def call(f, q, w, k, idx, top_k, causal, fp8, stats=None):
    B, Lq, HI, Di = q.shape
    Lk = k.shape[1]
    G, Kt = idx.shape[1], idx.shape[3]
    err = ctypes.create_string_buffer(512)
    st = (ctypes.c_ulonglong * 4)() if stats is not None else None
    rc = f(q.data_ptr(), w.data_ptr(), k.data_ptr(), idx.data_ptr(), B, Lq, Lk, HI, Di, G, Kt, top_k, int(causal),
           int(fp8), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), st, err, 512)
    if rc != 0:
        raise RuntimeError(err.value.decode())
    if stats is not None:
        stats[:] = list(st)


def fp8_values(x, scale):
    """The selector's fp8 rounding: x / scale rounded to e4m3 (nearest even, saturating), times the scale."""
    y = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return y * scale


def check_lists(idx, L, top_k, causal):
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
    sq = q.abs().max().float() / 448.0
    sk = k.abs().max().float() / 448.0
    kv = fp8_values(k[0], sk).double()
    worst = 0
    for t in rows:
        end = t + 1 if causal else k.shape[1]
        d = kv[:end] @ fp8_values(q[0, t], sq).double().T  # [end, HI]
        s = torch.relu(d) @ w[0, t].double()
        order = sorted(range(end), key=lambda j: (-s[j].item(), j)) if end <= 4096 else None
        if order is None:
            vals, ids = torch.sort(s, descending=True, stable=True)
            ref = set(ids[:top_k].tolist())
            kth = vals[min(top_k, end) - 1].item()
        else:
            ref = set(order[:top_k])
            kth = s[order[min(top_k, end) - 1]].item()
        got = set(x for x in idx[0, 0, t].tolist() if x >= 0)
        diff = ref ^ got
        tol = 1e-12 * max(1.0, abs(kth))
        bad = [j for j in diff if abs(s[j].item() - kth) > tol]
        worst = max(worst, len(bad))
    return worst


def scaled_mm_rate(n=8192, iters=20):
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0, device="cuda")
    for _ in range(3):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    e1.record()
    torch.cuda.synchronize()
    ms = e0.elapsed_time(e1) / iters
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("library")
    ap.add_argument("--L", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    f = load(a.library)
    torch.manual_seed(0)
    B, L, HI, Di, top_k, causal = 1, a.L, 64, 128, 2048, True
    q = torch.randn(B, L, HI, Di, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, L, Di, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(B, L, HI, device="cuda", dtype=torch.float32)
    idx = torch.empty(B, 1, L, top_k, device="cuda", dtype=torch.int32)
    pairs = L * (L + 1) // 2 if causal else L * L
    flop = 2.0 * HI * Di * pairs * B
    fp8_rate = scaled_mm_rate()
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "shape": {"B": B, "Lq": L, "Lk": L, "HI": HI, "Di": Di, "top_k": top_k, "causal": causal},
              "fp8_matmul_tflops": round(fp8_rate, 1), "runs": {}}
    for fp8 in (True, False):
        name = "fp8_e4m3" if fp8 else "bf16"
        idx.fill_(0x5a5a5a5a)
        stats = [0, 0, 0, 0]
        call(f, q, w, k, idx, top_k, causal, fp8, stats)
        torch.cuda.synchronize()
        well_formed = check_lists(idx, L, top_k, causal)
        bad = check_rows(idx, q, w, k, [L - 1, L // 2, 3000, 2047, 2048], top_k, causal) if fp8 else None
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ms = []
        for _ in range(a.iters):
            e0.record()
            call(f, q, w, k, idx, top_k, causal, fp8)
            e1.record()
            torch.cuda.synchronize()
            ms.append(e0.elapsed_time(e1))
        ms.sort()
        med = ms[len(ms) // 2]
        tflops = flop / (med * 1e-3) / 1e12
        result["runs"][name] = {"ms": round(med, 3), "ms_min": round(ms[0], 3), "tflops": round(tflops, 1),
                                "fraction_of_fp8_matmul": round(tflops / fp8_rate, 3),
                                "rows_screened": stats[0], "pairs_rescored_f64": stats[1],
                                "rows_fallback": stats[2], "compactions": stats[3], "lists_well_formed": well_formed,
                                "spot_rows_off_tie": bad}
        print(f"{name}: {med:.3f} ms (min {ms[0]:.3f}), {tflops:.1f} TFLOP/s = {tflops / fp8_rate:.3f} x fp8 matmul "
              f"({fp8_rate:.0f}); screened {stats[0]}, re-scored {stats[1]}, fallback {stats[2]}, compactions {stats[3]}, "
              f"well formed {well_formed}, spot check off-tie differences {bad}", flush=True)
    print(json.dumps(result))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    sys.exit(main())
