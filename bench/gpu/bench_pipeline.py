"""Selector -> tile_sparse pipeline against FlexAttention on the same lists, in one process on one GPU.

docs/design.md §7 `pipeline`: the tile16 shape (B=2, Hq=16, Hkv=1, D=128, Lq=4096, bf16, non-causal, 16 KV blocks
of 128 keys per Q tile of 128 queries) at Lk 4K / 8K / 16K / 32K with each selector in front: pooled R1,
pooled R4 and token_max fp8, with the options of `sparse-attn bench pipeline` (the library's defaults:
pooled forces the local block, token_max reserves it and reads the first query head of each group and k
as its index vectors). The three selectors of one Lk share q, k, v. Per (selector, Lk):
  ours  the selector alone (sparse_attn.pooled_select / token_max_select into TileLists allocated once),
        tile_sparse alone on those lists (trusted), and the two queued back to back;
  peer  FlexAttention (compiled, enable_gqa) on the same lists: the BlockMask built from idx / cnt with
        BlockMask.from_kv_blocks alone, flex alone, and selector + BlockMask + flex back to back (a new
        selection needs a new BlockMask, so building it belongs to the peer's pipeline).
Useful FLOPs = 4 * D * (query head, query, key) triples the lists select; effective TFLOP/s = useful
FLOPs / pipeline time, reported with its ratio to attention alone (target >= 0.92, docs/design.md §8).

Every configuration is verified before it is timed: the lists (the selector contract of
bench/harness.py), the pooled ids against a float64 torch recomputation of the selector (agreement
reported), our output poisoned with NaN then checked finite everywhere and on sampled rows against a
float64 reference of the same selection (harness.verify_rows), and our output against Flex's on the
whole tensor (relerr <= 2e-2). A failed check stops the run with exit status 1 after writing the rows
measured so far.

Usage: python3 bench_pipeline.py [--json PATH] [--quick] [--no-peers] [--selectors LIST] [--gap] [timing options]
       python3 bench_pipeline.py --selftest      (no GPU and no torch: list checks, pair count, JSON, table)
"""
import argparse
import inspect
import json
import math
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
from harness import BLOCK, VerificationError, ceil_div, forced_blocks, selected_pairs  # noqa: E402
from harness import selector_list_problems as check_lists  # noqa: E402

SHAPE = {"B": 2, "Hq": 16, "Hkv": 1, "D": 128, "Lq": 4096}
TOP_K = 16
LENGTHS = [4096, 8192, 16384, 32768]
LENGTHS_QUICK = [4096, 16384]
# (name, selector options)
SELECTORS = [("pooled R1", {"representatives": 1}), ("pooled R4", {"representatives": 4}),
             ("token_max fp8", {"precision": "fp8_e4m3"})]
FLEX_RELERR = 2e-2  # ours against Flex on the whole output


# ---- pure Python: arguments, lists, FLOPs, JSON, table -----------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="selector -> tile_sparse pipeline against FlexAttention (docs/design.md §7)")
    harness.add_args(ap)
    ap.add_argument("--gap", action="store_true",
                    help="also time the attention right after three stand-ins for a selector: a tiny kernel, a "
                         "read of q and k (the selector's input bytes), a 30 us GPU sleep")
    ap.add_argument("--selectors", help="comma-separated subset of: " + ", ".join(n for n, _ in SELECTORS))
    ap.add_argument("--selftest", action="store_true", help="check the pure-Python parts and exit (no GPU)")
    args = harness.parse(ap, argv)
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


# ---- GPU: the selectors, the Flex peer, references --------------------------------------------------

class Selector:
    """One selector writing TileLists idx [B, Hkv, Tq, top_k] / cnt [B, Hkv, Tq] allocated once."""

    def __init__(self, name, options, q, k, top_k):
        import torch
        import sparse_attn
        self.sa, self.name, self.options, self.top_k = sparse_attn, name, options, top_k
        B, Lq, Hq, _ = q.shape
        Hkv = k.shape[2]
        self.q, self.k = q, k
        self.qidx = q[:, :, ::Hq // Hkv]  # token_max's index vectors: the first query head of each group
        Tq = ceil_div(Lq, BLOCK)
        self.idx = torch.empty(B, Hkv, Tq, top_k, dtype=torch.int32, device=q.device)
        self.cnt = torch.empty(B, Hkv, Tq, dtype=torch.int32, device=q.device)

    def __call__(self):
        out = (self.idx, self.cnt)
        if self.name.startswith("pooled"):
            self.sa.pooled_select(self.q, self.k, top_k=self.top_k, causal=False, out=out, **self.options)
        else:
            self.sa.token_max_select(self.qidx, self.k, top_k=self.top_k, causal=False, format="tile", out=out,
                                     **self.options)


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

def run_case(ctx, name, options, Lk, q, k, v, flex_state):
    import torch
    B, Hq, Hkv, D, Lq = (SHAPE[x] for x in ("B", "Hq", "Hkv", "D", "Lq"))
    timer = ctx.timer
    row = {"workload": "pipeline", "selector": name, "Lk": Lk, "B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "Lq": Lq,
           "top_k": TOP_K, "causal": False, "dtype": "bf16"}

    # Lists: poisoned, one selector call, then the contract.
    sel = Selector(name, options, q, k, TOP_K)
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
        ref_ids = pooled_reference_ids(q, k, options["representatives"], TOP_K, name)
        row["ids_equal_reference_fraction"] = (ref_ids == sel.idx).all(dim=3).float().mean().item()
        if row["ids_equal_reference_fraction"] < 1.0:
            print("warning: %s Lk=%d: %.4f of the lists equal the float64 torch recomputation" % (
                name, Lk, row["ids_equal_reference_fraction"]), file=sys.stderr)
    selected = sel.idx.clone()

    # Our output: poisoned, lists validated, finite everywhere, right on sampled rows.
    out = torch.empty_like(q)
    attention = lambda trusted=True: ctx.sa.tile_sparse(q, k, v, sel.idx, sel.cnt, out=out, trusted=trusted)
    check = harness.verify_tile_output(harness.poisoned(lambda: attention(False), out), q, k, v, sel.idx, sel.cnt,
                                       False, ctx.gen, "%s Lk=%d: tile_sparse" % (name, Lk))
    row["relerr_vs_reference"], row["maxabs_vs_reference"] = check["relerr"], check["maxerr"]

    # The peer on the same lists.
    run_flex = mask = bm = None
    if ctx.flex is not None and flex_state.get("error") is None:
        try:
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            run_flex = lambda m: ctx.flex(qt, kt, vt, block_mask=m, enable_gqa=True)
            table = torch.zeros(B, Hkv, Lq // BLOCK, ceil_div(Lk, BLOCK), dtype=torch.int32, device=q.device)
            t0 = time.time()
            try:
                mask = lambda qb=flex_state["q_blocks"]: harness.tile_block_mask(sel.idx, sel.cnt, Lq, Lk, Hq, qb,
                                                                                 table)
                bm = mask()
                o = run_flex(bm)
            except Exception:
                if flex_state["q_blocks"]:
                    raise
                flex_state["q_blocks"] = True  # this torch's flex needs the transposed indices
                mask = lambda: harness.tile_block_mask(sel.idx, sel.cnt, Lq, Lk, Hq, True, table)
                bm = mask()
                o = run_flex(bm)
            torch.cuda.synchronize()
            row["flex_first_call_s"] = time.time() - t0  # includes the compile on a new shape
            row["flex_mask_q_blocks"] = flex_state["q_blocks"]
            if not torch.isfinite(o).all():
                raise VerificationError("%s Lk=%d: Flex output holds NaN or inf" % (name, Lk))
            row["relerr_vs_flex"] = harness.relerr(out, o.transpose(1, 2))
        except VerificationError:
            raise
        except Exception as e:  # a peer that fails is reported, not fatal
            row["flex_error"] = harness.short_error(e, 400)
            flex_state["error"] = row["flex_error"]
            run_flex = None
        if "relerr_vs_flex" in row and not row["relerr_vs_flex"] <= FLEX_RELERR:
            raise VerificationError("%s Lk=%d: ours against Flex on the same lists: relerr %.3e > %.0e" % (
                name, Lk, row["relerr_vs_flex"], FLEX_RELERR))

    # Timing.
    row["selector_ms"] = timer(sel)
    row["attention_ms"] = timer(attention)
    row["pipeline_ms"] = timer(lambda: (sel(), attention()))
    (row["selector_in_pipeline_ms"], row["attention_in_pipeline_ms"]), row["pipeline_host_ms"] = timer.parts(
        [sel, attention])
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
            (row["%s_ms" % what], row["attention_after_%s_ms" % what]), _ = timer.parts([fn, attention])
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
    torch, sa = harness.gpu_modules()
    ctx = Context()
    ctx.args, ctx.sa = args, sa
    ctx.timer = harness.Timer(args)
    ctx.sm_clock_hz = 1.98e9  # the H200's top SM clock: the --gap sleep lasts at least 30 us
    ctx.gen = torch.Generator().manual_seed(args.seed + 1)
    gen = harness.generator(args.seed)
    flex_state = {"error": None, "q_blocks": True}
    peers = harness.Peers(enabled=not args.no_peers)
    ctx.flex = peers.flex
    if ctx.flex is not None:
        flex_state["q_blocks"] = not flex_has_q_blocks_switch()
    meta = harness.run_meta(
        args, peers=peers.status, timer=ctx.timer.method, shape=dict(SHAPE, top_k=TOP_K, causal=False, dtype="bf16"),
        selectors=args.selector_names,
        pipeline="ours: selector + tile_sparse (trusted); peer: selector + BlockMask.from_kv_blocks + flex",
        gap="with --gap: attention_after_{tiny,read,sleep}_ms: the attention between events right after a tiny "
            "kernel, a float32 sum of q and of k (the selector's input bytes), or a >= 30 us GPU sleep; "
            "{tiny,read,sleep}_ms: the stand-in itself",
        in_pipeline="selector_in_pipeline_ms / attention_in_pipeline_ms: each part of ours between CUDA events "
                    "recorded around it while the two run back to back, L2 flushed before each round; "
                    "pipeline_host_ms: host time to enqueue one selector + attention round")
    res = harness.Results(args.json, meta)
    failure, t_start = None, time.time()
    B, Hq, Hkv, D, Lq = (SHAPE[x] for x in ("B", "Hq", "Hkv", "D", "Lq"))
    try:
        for Lk in lengths(args):
            q, k, v = harness.random_qkv(B, Lq, Lk, Hq, Hkv, D, gen)
            for name, options in SELECTORS:
                if name in args.selector_names:
                    res.add(run_case(ctx, name, options, Lk, q, k, v, flex_state))
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
        res.fail(failure)
    res.save()
    print()
    print(table(res.rows))
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
        res = harness.Results(path, {"device": "none"})
        res.add(row, echo=False)
        res.add(bare, echo=False)
        with open(path) as f:
            back = json.load(f)
        assert back["rows"][0]["effective_tflops"] == row["effective_tflops"] and back["meta"]["device"] == "none"

    a = parse_args(["--quick", "--no-peers", "--json", "o.json", "--selectors", "pooled R4"])
    assert a.quick and a.no_peers and a.json == "o.json" and lengths(a) == [4096, 16384] and a.samples == 5
    assert a.selector_names == ["pooled R4"]
    assert lengths(parse_args([])) == LENGTHS
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
