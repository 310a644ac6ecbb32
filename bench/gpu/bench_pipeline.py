"""Selector -> tile_sparse pipeline against FlexAttention on the same lists, in one process on one GPU.

DESIGN §7 `pipeline`: the tile16 shape (B=2, Hq=16, Hkv=1, D=128, Lq=4096, bf16, non-causal, 16 KV blocks
of 128 keys per Q tile of 128 queries) at Lk 4K / 8K / 16K / 32K with each selector in front: pooled R1,
pooled R4 and token_max fp8, with the options of `sparse-attn bench pipeline` (the library's defaults:
pooled forces the local block, token_max reserves it and reads the first query head of each group and k
as its index vectors). The three selectors of one Lk share q, k, v. Per (selector, Lk):
  ours  the selector alone (sa_bench_select_tiles into torch-owned TileLists), tile_sparse alone on those
        lists (sa_bench_attention, trusted), and the two queued back to back;
  peer  FlexAttention (compiled, enable_gqa) on the same lists: the BlockMask built from idx / cnt with
        BlockMask.from_kv_blocks alone, flex alone, and selector + BlockMask + flex back to back (a new
        selection needs a new BlockMask, so building it belongs to the peer's pipeline).
Useful FLOPs = 4 * D * (query head, query, key) triples the lists select; effective TFLOP/s = useful
FLOPs / pipeline time, reported with its ratio to attention alone (target >= 0.9, DESIGN §8).

Every configuration is verified before it is timed: the lists (ids ascending, distinct, in range, count
min(top_k, Tk), -1 past the count, the selector's forced local block present), the pooled ids against a
float64 torch recomputation of the selector (agreement reported), our output poisoned with NaN then
checked finite everywhere and on sampled rows against a float64 reference of the same selection
(relerr <= 8e-3, max abs <= 3e-2, the bounds of `sparse-attn bench`), and our output against Flex's on
the whole tensor (relerr <= 2e-2). A failed check stops the run with exit status 1 after writing the
rows measured so far.

Usage: python3 bench_pipeline.py --lib libsa_bench.so [--json PATH] [--quick] [--no-flex] [--reps N] [--inner N]
       python3 bench_pipeline.py --selftest      (no GPU and no torch: list checks, pair count, JSON, table)
"""
import argparse
import ctypes
import datetime
import inspect
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback

BLOCK = 128
SHAPE = {"B": 2, "Hq": 16, "Hkv": 1, "D": 128, "Lq": 4096}
TOP_K = 16
LENGTHS = [4096, 8192, 16384, 32768]
LENGTHS_QUICK = [4096, 16384]
# (name, selector code of sa_bench_select_tiles)
SELECTORS = [("pooled R1", 0), ("pooled R4", 1), ("token_max fp8", 3)]
REF_RELERR, REF_MAXABS = 8e-3, 3e-2  # ours against the float64 reference on sampled rows
FLEX_RELERR = 2e-2                    # ours against Flex on the whole output


class VerificationError(Exception):
    pass


# ---- pure Python: arguments, lists, FLOPs, JSON, table -----------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="selector -> tile_sparse pipeline against FlexAttention (DESIGN §7)")
    ap.add_argument("--lib", help="libsa_bench.so built from bench/gpu/capi.cpp")
    ap.add_argument("--json", help="write the results as JSON to this file")
    ap.add_argument("--quick", action="store_true", help="Lk 4K and 16K only")
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peer")
    ap.add_argument("--reps", type=int, default=15, help="timing samples per figure (median)")
    ap.add_argument("--inner", type=int, default=10, help="back-to-back calls per sample")
    ap.add_argument("--gap", action="store_true",
                    help="also time the attention right after three stand-ins for a selector: a tiny kernel, a "
                         "read of q and k (the selector's input bytes), a 30 us GPU sleep")
    ap.add_argument("--token-max-plain", action="store_true",
                    help="launch token_max's kernels plainly instead of as a programmatic chain (A/B runs)")
    ap.add_argument("--selectors", help="comma-separated subset of: " + ", ".join(n for n, _ in SELECTORS))
    ap.add_argument("--selftest", action="store_true", help="check the pure-Python parts and exit (no GPU)")
    args = ap.parse_args(argv)
    if not args.selftest and not args.lib:
        ap.error("--lib is required (unless --selftest)")
    if args.reps < 1 or args.inner < 1:
        ap.error("--reps and --inner must be >= 1")
    known = [n for n, _ in SELECTORS]
    args.selector_names = known
    if args.selectors:
        args.selector_names = [x.strip() for x in args.selectors.split(",") if x.strip()]
        unknown = [x for x in args.selector_names if x not in known]
        if unknown or not args.selector_names:
            ap.error("--selectors: unknown %r (choose from %s)" % (unknown or args.selectors, ", ".join(known)))
    return args


def lengths(args):
    return LENGTHS_QUICK if args.quick else LENGTHS


def ceil_div(a, b):
    return -(-a // b)


def forced_blocks(selector, t, Lq, Lk):
    """Blocks the selector must keep for Q tile t (non-causal): pooled forces the block holding key
    min(first query * Lk / Lq, Lk - 1); token_max reserves the blocks of the aligned keys
    clamp(i + Lk - Lq, 0, Lk - 1) of the tile's queries i."""
    Tk = ceil_div(Lk, BLOCK)
    i0, i1 = t * BLOCK, min(Lq, (t + 1) * BLOCK) - 1
    if selector.startswith("pooled"):
        return {min(i0 * Lk // Lq // BLOCK, Tk - 1)}
    aligned = lambda i: min(max(i + Lk - Lq, 0), Lk - 1)
    return set(range(aligned(i0) // BLOCK, aligned(i1) // BLOCK + 1))


def check_lists(idx, cnt, Lq, Lk, top_k, selector, limit=10):
    """Problems of TileLists idx [B][G][Tq][Kmax], cnt [B][G][Tq] (nested lists) as a non-causal selector
    must produce them: count min(top_k, Tk), ids ascending, distinct, in [0, Tk), -1 in the unused slots,
    the forced blocks present. Returns at most `limit` messages; empty when all hold."""
    Tk, Tq = ceil_div(Lk, BLOCK), ceil_div(Lq, BLOCK)
    want = min(top_k, Tk)
    problems = []

    def bad(msg):
        if len(problems) < limit:
            problems.append(msg)

    if len(idx) != len(cnt):
        return ["idx holds %d batches, cnt %d" % (len(idx), len(cnt))]
    for b, (ib, cb) in enumerate(zip(idx, cnt)):
        if len(ib) != len(cb):
            bad("batch %d: idx holds %d groups, cnt %d" % (b, len(ib), len(cb)))
            continue
        for g, (ig, cg) in enumerate(zip(ib, cb)):
            if len(ig) != Tq or len(cg) != Tq:
                bad("[%d, %d]: %d / %d Q tiles, expected %d" % (b, g, len(ig), len(cg), Tq))
                continue
            for t, (row, c) in enumerate(zip(ig, cg)):
                at = "[%d, %d, %d]" % (b, g, t)
                if c != want:
                    bad("cnt%s = %d, expected min(top_k, Tk) = %d" % (at, c, want))
                    continue
                ids = row[:c]
                if any(j < 0 or j >= Tk for j in ids):
                    bad("idx%s holds an id outside [0, %d): %s" % (at, Tk, ids))
                elif any(a >= b_ for a, b_ in zip(ids, ids[1:])):
                    bad("idx%s is not strictly ascending: %s" % (at, ids))
                elif any(j != -1 for j in row[c:]):
                    bad("idx%s: slots past the count are not -1: %s" % (at, row[c:]))
                else:
                    missing = forced_blocks(selector, t, Lq, Lk) - set(ids)
                    if missing:
                        bad("idx%s lacks the forced block(s) %s: %s" % (at, sorted(missing), ids))
    return problems


def selected_pairs(idx, cnt, Lq, Lk, Hq):
    """(query head, query, key) triples the TileLists select, non-causal: per list, the tile's queries
    times the keys of its blocks (the last tile / block may be partial), times the heads sharing it."""
    total = 0
    for ib, cb in zip(idx, cnt):
        heads = Hq // len(cb)
        for ig, cg in zip(ib, cb):
            for t, (row, c) in enumerate(zip(ig, cg)):
                rows = min(Lq, (t + 1) * BLOCK) - t * BLOCK
                keys = sum(min(Lk, (j + 1) * BLOCK) - j * BLOCK for j in row[:c])
                total += heads * rows * keys
    return total


def useful_flops(pairs, D):
    return 4 * D * pairs


def derived(row):
    """Rates and ratios from the times (ms) and useful FLOPs of a row; figures missing stay missing."""
    f = row["useful_gflop"] * 1e9
    rate = lambda key: f / row[key] / 1e9 if row.get(key) else None
    out = {"attention_only_tflops": rate("attention_ms"), "effective_tflops": rate("pipeline_ms"),
           "flex_tflops": rate("flex_ms"), "flex_effective_tflops": rate("flex_pipeline_ms")}
    if row.get("attention_ms") and row.get("pipeline_ms"):
        out["effective_over_attention_only"] = row["attention_ms"] / row["pipeline_ms"]
    if row.get("flex_ms") and row.get("flex_pipeline_ms"):
        out["flex_effective_over_flex_only"] = row["flex_ms"] / row["flex_pipeline_ms"]
    if row.get("pipeline_ms") and row.get("flex_pipeline_ms"):
        out["pipeline_speedup_over_flex_pipeline"] = row["flex_pipeline_ms"] / row["pipeline_ms"]
    return {k: v for k, v in out.items() if v is not None}


def write_json(path, meta, rows):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def table(rows):
    """The short table printed last: ours (selector, attention, pipeline) then the Flex peer."""
    fmt = lambda x, w, p: ("%*.*f" % (w, p, x)) if isinstance(x, (int, float)) else "%*s" % (w, "-")
    lines = ["%-14s %6s | %7s %7s %7s %7s %7s %7s %5s | %7s %7s %7s %7s %5s | %6s | %8s" % (
        "selector", "Lk", "sel ms", "attn ms", "pipe ms", "sel in", "attn in", "TFLOP/s", "ratio", "mask ms", "flex ms", "fpipe", "TFLOP/s",
        "ratio", "x flex", "rel flex")]
    for r in rows:
        lines.append("%-14s %6d | %s %s %s %s %s %s %s | %s %s %s %s %s | %s | %8s" % (
            r["selector"], r["Lk"], fmt(r.get("selector_ms"), 7, 4), fmt(r.get("attention_ms"), 7, 4),
            fmt(r.get("pipeline_ms"), 7, 4), fmt(r.get("selector_in_pipeline_ms"), 7, 4),
            fmt(r.get("attention_in_pipeline_ms"), 7, 4), fmt(r.get("effective_tflops"), 7, 1),
            fmt(r.get("effective_over_attention_only"), 5, 3), fmt(r.get("flex_mask_ms"), 7, 4),
            fmt(r.get("flex_ms"), 7, 4), fmt(r.get("flex_pipeline_ms"), 7, 4), fmt(r.get("flex_effective_tflops"), 7, 1),
            fmt(r.get("flex_effective_over_flex_only"), 5, 3), fmt(r.get("pipeline_speedup_over_flex_pipeline"), 6, 2),
            "%.2e" % r["relerr_vs_flex"] if "relerr_vs_flex" in r else "-"))
    lines.append("TFLOP/s: useful FLOPs (4 * D * selected (head, query, key) triples) / pipeline time; ratio: over "
                 "attention alone (ours) or flex alone (peer); x flex: peer pipeline time / ours; sel in / attn in: "
                 "each part timed between events inside the pipeline.")
    return "\n".join(lines)


# ---- GPU: the selector hook, the Flex peer, references ----------------------------------------------

def load_select(path):
    f = ctypes.CDLL(path).sa_bench_select_tiles
    i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    f.argtypes = [ci, ci, vp, vp, vp, vp, i64, i64, i64, i64, i64, i64, i64, i64, ci, ci, vp, vp, i64, vp,
                  ctypes.c_char_p, ci]
    f.restype = ci
    return f


class Selector:
    """One selector writing TileLists idx [B, Hkv, Tq, top_k] / cnt [B, Hkv, Tq] that torch owns."""

    def __init__(self, fn, code, q, k, top_k):
        import torch
        self.fn, self.code, self.q, self.k, self.top_k = fn, code, q, k, top_k
        B, Lq, Hq, D = q.shape
        Hkv = k.shape[2]
        Tq = ceil_div(Lq, BLOCK)
        self.idx = torch.empty(B, Hkv, Tq, top_k, dtype=torch.int32, device=q.device)
        self.cnt = torch.empty(B, Hkv, Tq, dtype=torch.int32, device=q.device)
        self.err = ctypes.create_string_buffer(1024)

    def __call__(self):
        import torch
        q, k = self.q, self.k
        B, Lq, Hq, D = q.shape
        Lk, Hkv = k.shape[1], k.shape[2]
        rc = self.fn(self.code, 0 if q.dtype == torch.bfloat16 else 1, q.data_ptr(), k.data_ptr(), None, None, B, Lq,
                     Lk, Hq, Hkv, D, 0, 0, 0, self.top_k, self.idx.data_ptr(), self.cnt.data_ptr(), self.top_k,
                     torch.cuda.current_stream().cuda_stream, self.err, len(self.err))
        if rc != 0:
            raise RuntimeError(self.err.value.decode(errors="replace"))


class FlexMask:
    """The BlockMask of TileLists, rebuilt on every call as a pipeline must: idx goes into the first slots
    of a [B, G, Tq, Tk] table (from_kv_blocks reads a row's first cnt entries only), then
    BlockMask.from_kv_blocks. G = Hkv lists are repeated over the heads of a group when Hkv > 1.
    q_blocks=False skips the transposed (backward-only) indices where this torch offers it."""

    def __init__(self, idx, cnt, Lq, Lk, Hq, q_blocks):
        import torch
        self.idx, self.cnt, self.Lq, self.Lk = idx, cnt, Lq, Lk
        B, G, Tq, _ = idx.shape
        self.group = Hq // G if G > 1 else 1
        self.table = torch.zeros(B, G, Tq, ceil_div(Lk, BLOCK), dtype=torch.int32, device=idx.device)
        self.kw = {} if q_blocks else {"compute_q_blocks": False}

    def __call__(self):
        from torch.nn.attention.flex_attention import BlockMask
        self.table[..., :self.idx.shape[3]].copy_(self.idx)
        num, tab = self.cnt, self.table
        if self.group > 1:
            num, tab = num.repeat_interleave(self.group, dim=1), tab.repeat_interleave(self.group, dim=1)
        return BlockMask.from_kv_blocks(num, tab, BLOCK_SIZE=BLOCK, seq_lengths=(self.Lq, self.Lk), **self.kw)


def flex_has_q_blocks_switch():
    from torch.nn.attention.flex_attention import BlockMask
    try:
        return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    except (TypeError, ValueError):
        return False


def compiled_graphs():
    """Graphs dynamo has compiled so far (None where this torch does not count them)."""
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return None


def reference_rows(out, q, k, v, idx, cnt, gen, tiles=4, per_tile=4):
    """Relative and maximum error of `out` on sampled rows against float64 attention over the keys of each
    row's selected blocks: the first and last (batch, head), each with the first, the last and random
    tiles, `per_tile` random queries per tile."""
    import torch
    B, Lq, Hq, D = q.shape
    Lk, G = k.shape[1], idx.shape[1]
    group, Tq = Hq // G, ceil_div(Lq, BLOCK)
    idx_h, cnt_h = idx.cpu(), cnt.cpu()
    scale = 1.0 / math.sqrt(D)
    num = den = maxabs = 0.0
    for b, h in [(0, 0), (B - 1, Hq - 1)]:
        g = h // group
        picked = [0, Tq - 1] + torch.randint(0, Tq, (max(0, tiles - 2),), generator=gen).tolist()
        for t in picked:
            rows_in = min(Lq, (t + 1) * BLOCK) - t * BLOCK
            rows = (t * BLOCK + torch.randint(0, rows_in, (per_tile,), generator=gen)).tolist()
            c = int(cnt_h[b, g, t])
            keys = torch.cat([torch.arange(j * BLOCK, min(Lk, (j + 1) * BLOCK)) for j in idx_h[b, g, t, :c].tolist()])
            keys = keys.to(q.device)
            qs = q[b, rows, h].double()
            s = qs @ k[b, keys, g].double().T * scale
            ref = torch.softmax(s, dim=-1) @ v[b, keys, g].double()
            got = out[b, rows, h].double()
            num += ((got - ref) ** 2).sum().item()
            den += (ref ** 2).sum().item()
            maxabs = max(maxabs, (got - ref).abs().max().item())
    return math.sqrt(num / den), maxabs


def pooled_reference_ids(q, k, r, top_k, selector):
    """The pooled selector recomputed in torch, float64: means of 128 / r tokens rounded to float32, block
    score = max over representative pairs and the group's heads, the forced block first, top-k ids
    ascending. Lengths must be multiples of 128. Returns idx [B, Hkv, Tq, top_k] int32."""
    import torch
    B, Lq, Hq, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    span, group, Tq, Tk = BLOCK // r, Hq // Hkv, Lq // BLOCK, Lk // BLOCK
    qm = (q.double().view(B, Lq // span, span, Hq, D).sum(2) / span).float().double()
    km = (k.double().view(B, Lk // span, span, Hkv, D).sum(2) / span).float().double()
    s = torch.einsum("bagxd,bcgd->bgxac", qm.view(B, Lq // span, Hkv, group, D), km)
    s = s.reshape(B, Hkv, group, Tq, r, Tk, r).amax(dim=(2, 4, 6))
    for t in range(Tq):
        for j in forced_blocks(selector, t, Lq, Lk):
            s[:, :, t, j] = math.inf
    return s.topk(min(top_k, Tk), dim=3).indices.sort(dim=3).values.to(torch.int32)


# ---- one (selector, Lk): verify, then time ----------------------------------------------------------

def bench_split(fns, reps=15, inner=10):
    """Median over `reps` samples of each part's mean time (ms) when the parts `fns` run back to back,
    `inner` rounds per sample, with a CUDA event between consecutive parts: where a pipeline's time goes
    beyond the parts timed alone (a part may run slower after the others, e.g. reading inputs that the
    previous part evicted from L2). Also returns the median host time (ms) to enqueue one round: where it
    reaches the GPU time, the host, not the GPU, sets the pace."""
    import torch
    for _ in range(3):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    samples, host = [], []
    for _ in range(reps):
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(len(fns) + 1)] for _ in range(inner)]
        t0 = time.perf_counter()
        for i in range(inner):
            ev[i][0].record()
            for j, fn in enumerate(fns):
                fn()
                ev[i][j + 1].record()
        host.append((time.perf_counter() - t0) * 1e3 / inner)
        ev[-1][-1].synchronize()
        samples.append([sum(ev[i][j].elapsed_time(ev[i][j + 1]) for i in range(inner)) / inner
                        for j in range(len(fns))])
    parts = [sorted(x[j] for x in samples)[len(samples) // 2] for j in range(len(fns))]
    return parts, sorted(host)[len(host) // 2]


def run_case(ctx, name, code, Lk, q, k, v, flex_state):
    import torch
    from bench_attention import Ours, bench, relerr
    B, Hq, Hkv, D, Lq = (SHAPE[x] for x in ("B", "Hq", "Hkv", "D", "Lq"))
    timer = lambda fn: bench(fn, reps=ctx.args.reps, inner=ctx.args.inner)
    row = {"workload": "pipeline", "selector": name, "Lk": Lk, "B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "Lq": Lq,
           "top_k": TOP_K, "causal": False, "dtype": "bf16"}

    # Lists: poisoned, one selector call, then the contract.
    sel = Selector(ctx.select, code, q, k, TOP_K)
    sel.idx.fill_(-7)
    sel.cnt.fill_(-7)
    sel()
    torch.cuda.synchronize()
    idx_l, cnt_l = sel.idx.tolist(), sel.cnt.tolist()
    problems = check_lists(idx_l, cnt_l, Lq, Lk, TOP_K, name)
    if problems:
        raise VerificationError("%s Lk=%d: lists break the selector contract: %s" % (name, Lk, "; ".join(problems)))
    row["lists_checked"] = True
    pairs = selected_pairs(idx_l, cnt_l, Lq, Lk, Hq)
    row["selected_pairs"] = pairs
    row["useful_gflop"] = useful_flops(pairs, D) / 1e9
    if name.startswith("pooled"):
        ref_ids = pooled_reference_ids(q, k, 1 if name.endswith("R1") else 4, TOP_K, name)
        row["ids_equal_reference_fraction"] = (ref_ids == sel.idx).all(dim=3).float().mean().item()
        if row["ids_equal_reference_fraction"] < 1.0:
            print("warning: %s Lk=%d: %.4f of the lists equal the float64 torch recomputation" % (
                name, Lk, row["ids_equal_reference_fraction"]), file=sys.stderr)
    selected = sel.idx.clone()

    # Our output: poisoned, lists validated on the device, finite everywhere, right on sampled rows.
    ours = Ours(ctx.attention, q, k, v, False, sel.idx, sel.cnt)
    ours.out.fill_(float("nan"))
    ours(trusted=False)
    torch.cuda.synchronize()
    if not torch.isfinite(ours.out).all():
        raise VerificationError("%s Lk=%d: tile_sparse left NaN or inf in its output" % (name, Lk))
    rel, mx = reference_rows(ours.out, q, k, v, sel.idx, sel.cnt, ctx.gen)
    row["relerr_vs_reference"], row["maxabs_vs_reference"] = rel, mx
    if not (rel <= REF_RELERR and mx <= REF_MAXABS):
        raise VerificationError("%s Lk=%d: tile_sparse against the float64 reference: relerr %.2e (bound %.0e), "
                                "max abs %.2e (bound %.0e)" % (name, Lk, rel, REF_RELERR, mx, REF_MAXABS))

    # The peer on the same lists.
    run_flex = mask = bm = None
    if ctx.flex is not None and flex_state.get("error") is None:
        try:
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            run_flex = lambda m: ctx.flex(qt, kt, vt, block_mask=m, enable_gqa=True)
            t0 = time.time()
            try:
                mask = FlexMask(sel.idx, sel.cnt, Lq, Lk, Hq, flex_state["q_blocks"])
                bm = mask()
                o = run_flex(bm)
            except Exception:
                if flex_state["q_blocks"]:
                    raise
                flex_state["q_blocks"] = True  # this torch's flex needs the transposed indices
                mask = FlexMask(sel.idx, sel.cnt, Lq, Lk, Hq, True)
                bm = mask()
                o = run_flex(bm)
            torch.cuda.synchronize()
            row["flex_first_call_s"] = time.time() - t0  # includes the compile on a new shape
            row["flex_mask_q_blocks"] = flex_state["q_blocks"]
            if not torch.isfinite(o).all():
                raise VerificationError("%s Lk=%d: Flex output holds NaN or inf" % (name, Lk))
            row["relerr_vs_flex"] = relerr(ours.out, o.transpose(1, 2))
        except VerificationError:
            raise
        except Exception as e:  # a peer that fails is reported, not fatal
            row["flex_error"] = str(e)[:400]
            flex_state["error"] = row["flex_error"]
            run_flex = None
        if "relerr_vs_flex" in row and not row["relerr_vs_flex"] <= FLEX_RELERR:
            raise VerificationError("%s Lk=%d: ours against Flex on the same lists: relerr %.3e > %.0e" % (
                name, Lk, row["relerr_vs_flex"], FLEX_RELERR))

    # Timing.
    row["selector_ms"] = timer(sel)
    row["attention_ms"] = timer(lambda: ours(trusted=True))
    row["pipeline_ms"] = timer(lambda: (sel(), ours(trusted=True)))
    (row["selector_in_pipeline_ms"], row["attention_in_pipeline_ms"]), row["pipeline_host_ms"] = bench_split(
        [sel, lambda: ours(trusted=True)], reps=ctx.args.reps, inner=ctx.args.inner)
    if ctx.args.gap:
        # What the attention pays for running right after something else: launch and SM reconfiguration
        # (any kernel), L2 contents (a read of the selector's input bytes), clock and power (an idle wait).
        tiny_buf = torch.zeros(1, device=q.device)
        stand_ins = {
            "tiny": lambda: tiny_buf.add_(1.0),
            "read": lambda: (torch.sum(q, dtype=torch.float32), torch.sum(k, dtype=torch.float32)),
            "sleep": lambda: torch.cuda._sleep(int(30e-6 * ctx.sm_clock_hz)),  # >= 30 us
        }
        for what, fn in stand_ins.items():
            (row["%s_ms" % what], row["attention_after_%s_ms" % what]), _ = bench_split(
                [fn, lambda: ours(trusted=True)], reps=ctx.args.reps, inner=ctx.args.inner)
    if run_flex is not None:
        graphs = compiled_graphs()
        row["flex_mask_ms"] = timer(mask)
        row["flex_ms"] = timer(lambda: run_flex(bm))
        row["flex_pipeline_ms"] = timer(lambda: (sel(), run_flex(mask())))
        after = compiled_graphs()
        if graphs is not None and after is not None:
            row["flex_compiles_while_timing"] = after - graphs
            if after != graphs:
                print("warning: %s Lk=%d: flex compiled %d graph(s) while timed" % (name, Lk, after - graphs),
                      file=sys.stderr)
    torch.cuda.synchronize()
    if not torch.equal(sel.idx, selected):
        raise VerificationError("%s Lk=%d: the selector's lists changed between calls" % (name, Lk))
    row.update(derived(row))
    return row


class Context:
    pass


def run(args):
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_attention import load_lib

    ctx = Context()
    ctx.args = args
    ctx.attention = load_lib(args.lib)
    ctx.select = load_select(args.lib)
    ctx.sm_clock_hz = 1.98e9  # the H200's top SM clock: the --gap sleep lasts at least 30 us
    ctypes.CDLL(args.lib).sa_bench_set_token_max_pdl(ctypes.c_int(0 if args.token_max_plain else 1))
    ctx.gen = torch.Generator().manual_seed(4321)
    torch.manual_seed(1234)
    dev = torch.device("cuda")
    flex_state = {"error": None, "q_blocks": True}
    ctx.flex = None
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention
            ctx.flex = torch.compile(flex_attention, dynamic=False)
            flex_state["q_blocks"] = not flex_has_q_blocks_switch()
        except Exception as e:
            flex_state["error"] = str(e)[:400]
    meta = {
        "device": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "lib": os.path.abspath(args.lib),
        "shape": dict(SHAPE, top_k=TOP_K, causal=False, dtype="bf16"),
        "selectors": args.selector_names,
        "token_max_launches": "plain" if args.token_max_plain else "programmatic chain",
        "timing": "median of %d samples of the mean of %d back-to-back calls after 5 warm-up calls, CUDA events"
                  % (args.reps, args.inner),
        "useful_flops": "4 * D * selected (query head, query, key) triples",
        "pipeline": "ours: selector + tile_sparse (trusted); peer: selector + BlockMask.from_kv_blocks + flex",
        "gap": "with --gap: attention_after_{tiny,read,sleep}_ms: the attention between events right after a tiny "
               "kernel, a float32 sum of q and of k (the selector's input bytes), or a >= 30 us GPU sleep; "
               "{tiny,read,sleep}_ms: the stand-in itself",
        "in_pipeline": "selector_in_pipeline_ms / attention_in_pipeline_ms: each part of ours between CUDA events "
                       "recorded around it while the two run back to back; pipeline_host_ms: host time to enqueue one "
                       "selector + attention round",
    }
    rows, failure, t_start = [], None, time.time()
    B, Hq, Hkv, D, Lq = (SHAPE[x] for x in ("B", "Hq", "Hkv", "D", "Lq"))
    try:
        for Lk in lengths(args):
            q = torch.randn(B, Lq, Hq, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(B, Lk, Hkv, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn(B, Lk, Hkv, D, device=dev, dtype=torch.bfloat16)
            for name, code in SELECTORS:
                if name not in args.selector_names:
                    continue
                row = run_case(ctx, name, code, Lk, q, k, v, flex_state)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del q, k, v
    except VerificationError as e:
        failure = str(e)
    except Exception as e:  # our library or the setup failed: keep the rows measured so far
        traceback.print_exc()
        failure = "%s: %s" % (type(e).__name__, e)
    meta["elapsed_s"] = time.time() - t_start
    if flex_state["error"] is not None:
        meta["flex_error"] = flex_state["error"]
    if failure:
        meta["failure"] = failure
    if args.json:
        write_json(args.json, meta, rows)
    print()
    print(table(rows))
    if failure:
        print("FAILED: " + failure, file=sys.stderr)
        return 1
    return 0


# ---- self-check of the pure-Python parts (no GPU, no torch) -------------------------------------------

def selftest():
    Lq, Lk, top_k = 4096, 16384, 16
    Tq, Tk = Lq // BLOCK, Lk // BLOCK
    assert forced_blocks("pooled R1", 3, Lq, Lk) == {12}
    assert forced_blocks("token_max fp8", 3, Lq, Lk) == {99}
    assert forced_blocks("token_max fp8", 0, 4096, 4096) == {0}
    assert forced_blocks("token_max fp8", 0, 200, 300) == {0, 1}  # aligned keys 100..227 span two blocks
    assert forced_blocks("pooled R4", 31, 4096, 4000) == {30}    # 3968 * 4000 // 4096 = 3875: block 30

    def lists(selector, B=2, G=1):
        idx, cnt = [], []
        for b in range(B):
            ib, cb = [], []
            for g in range(G):
                ig, cg = [], []
                for t in range(Tq):
                    ids = set(forced_blocks(selector, t, Lq, Lk))
                    j = (7 * t + 3 * b) % Tk
                    while len(ids) < top_k:
                        ids.add(j)
                        j = (j + 5) % Tk
                    ig.append(sorted(ids))
                    cg.append(top_k)
                ib.append(ig)
                cb.append(cg)
            idx.append(ib)
            cnt.append(cb)
        return idx, cnt

    for sel in ("pooled R1", "token_max fp8"):
        idx, cnt = lists(sel)
        assert check_lists(idx, cnt, Lq, Lk, top_k, sel) == [], check_lists(idx, cnt, Lq, Lk, top_k, sel)
        assert selected_pairs(idx, cnt, Lq, Lk, 16) == 2 * 16 * Tq * top_k * BLOCK * BLOCK
    assert useful_flops(2 * 16 * Tq * top_k * BLOCK * BLOCK, 128) == 4 * 128 * 268435456

    def broken(edit, sel="pooled R1"):
        idx, cnt = lists(sel)
        edit(idx, cnt)
        return check_lists(idx, cnt, Lq, Lk, top_k, sel)

    def swap(i, c):
        r = i[1][0][5]
        r[0], r[1] = r[1], r[0]

    def dup(i, c):
        r = i[0][0][2]
        r[3] = r[2]

    def out_of_range(i, c):
        i[0][0][4][-1] = Tk

    def negative(i, c):
        i[0][0][4][0] = -1

    def short(i, c):
        c[0][0][6] = top_k - 1

    def drop_forced(i, c):  # tile 3 forces block 12: replace it keeping the list sorted
        r = [j for j in i[0][0][3] if j != 12]
        extra = next(j for j in range(Tk - 1, -1, -1) if j not in r)
        i[0][0][3] = sorted(r + [extra])

    for edit, needle in ((swap, "ascending"), (dup, "ascending"), (out_of_range, "outside"), (negative, "outside"),
                         (short, "expected min"), (drop_forced, "forced")):
        p = broken(edit)
        assert len(p) == 1 and needle in p[0], (edit.__name__, p)

    # Capacity above top_k: -1 past the count is required.
    idx, cnt = lists("pooled R1")
    for row in idx[0][0]:
        row.append(-1)
    assert check_lists(idx, cnt, Lq, Lk, top_k, "pooled R1") == []
    idx[0][0][9][-1] = 0
    assert "past the count" in check_lists(idx, cnt, Lq, Lk, top_k, "pooled R1")[0]
    # Partial last tile and block: fewer pairs.
    assert selected_pairs([[[[0, 1]]]], [[[2]]], 100, 200, 4) == 4 * 100 * 200
    # Few blocks: the count is min(top_k, Tk).
    assert "expected min(top_k, Tk) = 2" in check_lists([[[[0, 1]]]], [[[3]]], 100, 200, 16, "pooled R1")[0]

    row = {"selector": "pooled R1", "Lk": 16384, "useful_gflop": 137.438953472, "selector_ms": 0.05,
           "attention_ms": 0.3, "pipeline_ms": 0.33, "flex_ms": 0.36, "flex_pipeline_ms": 0.6, "flex_mask_ms": 0.1,
           "relerr_vs_flex": 2.7e-3}
    row.update(derived(row))
    assert abs(row["effective_tflops"] - 137.438953472 / 0.33) < 1e-6
    assert abs(row["effective_over_attention_only"] - 0.3 / 0.33) < 1e-12
    assert abs(row["pipeline_speedup_over_flex_pipeline"] - 0.6 / 0.33) < 1e-12
    bare = {"selector": "token_max fp8", "Lk": 4096, "useful_gflop": 1.0, "selector_ms": 0.1, "attention_ms": 0.2,
            "pipeline_ms": 0.3}
    bare.update(derived(bare))
    assert "flex_tflops" not in bare and "pipeline_speedup_over_flex_pipeline" not in bare
    text = table([row, bare])
    assert "pooled R1" in text and "token_max fp8" in text and "2.70e-03" in text
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "r.json")
        write_json(path, {"device": "none"}, [row, bare])
        with open(path) as f:
            back = json.load(f)
        assert back["rows"][0]["effective_tflops"] == row["effective_tflops"] and back["meta"]["device"] == "none"

    a = parse_args(["--lib", "x.so", "--quick", "--no-flex", "--json", "o.json"])
    assert a.quick and a.no_flex and a.json == "o.json" and lengths(a) == [4096, 16384] and a.reps == 15
    assert lengths(parse_args(["--lib", "x.so"])) == LENGTHS
    print(text)
    print("selftest ok")
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.selftest:
        return selftest()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
