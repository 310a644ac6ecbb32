"""Schedules for per-query block lists (QueryLists) against their peers, in one process on one GPU.

Issue 5 / docs/design.md §7. For a QueryLists selection it times every schedule of the library on the same
torch tensors, through the sparse_attn package:
  kv_centric     query_sparse, KV-centric (reverse index -> partials -> combine), f32 or bf16 partials;
                 its reverse index / attention / combine breakdown is `sparse-attn bench query16of32`'s;
  group_centric  query_sparse, group-centric;
  q_centric      query_lists_to_tile_lists on the device (one kernel, no host round trip) + tile_sparse;
                 the conversion alone; tile_sparse alone; and q_centric_host, the same conversion on the
                 host (lists to the host and TileLists back) + tile_sparse, for comparison;
and the peers: FlexAttention with the per-query mask (a mask_mod reading a [B, Hkv, Lq, Tk] bool table
built from the lists, compiled, enable_gqa) and dense SDPA (cuDNN and flash backends, FA4 where
importable) plus our dense.

Workloads: query16of32 (B=8, Hq=16, Hkv=1, L=4096, 16 random blocks per query of 32), query-long (B=1,
Hq=32, Hkv=8, L=32768, 16 of 256), the two tile16 patterns as QueryLists (every query of a tile holds the
tile's list), and the overlap sweep: a base list per tile, each query keeping each base block with
probability 1 - f and drawing the rest uniformly from the blocks it did not keep (f = 0: one list per
tile; f = 1: independent random lists), on the query16of32 shape and on the query-long shape.
For each configuration the planner (sparse_attn.plan_schedule on the same lists) gives its choice and
estimates; the planner check compares that choice with the measured fastest schedule.

Verification comes before timing: outputs are poisoned with NaN, then every implementation is compared
with a float64 reference on sampled rows of two (batch, head) pairs under the bound of docs/design.md §6
(bench/harness.py, verify_rows); q_centric is checked against the reference of its own semantics (each
query sees its tile's union), and its device conversion must equal the union torch forms from the same
lists. Implementations with the per-query semantics are also compared with each other on the full
output, and kv_centric twice with itself (bitwise).

Usage: python3 bench_query.py [--json PATH] [--quick] [--parts LIST] [--no-peers] [--no-host] [--sweep-f F,F,...]
                              [--merge-window N] [--budget-s S] [--print-json] [timing options, see --help]
       python3 bench_query.py --selftest        (CPU only: list generators, union, block mask, references)
       python3 bench_query.py --markdown JSON... (tables of saved results)
"""
import argparse
import json
import math
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402
from harness import BLOCK  # noqa: E402

ALL_PARTS = ["query16of32", "query-long", "tile16", "sweep16", "sweeplong"]
DEVICE = "cuda"
# Phases of a schedule (no speed-up or useful rate of their own); the kv_* ones appear in results saved
# before the breakdown moved to `sparse-attn bench`.
PARTIAL_TIMES = {"kv_reverse_index", "kv_attention", "kv_combine", "q_centric_conversion", "q_centric_host_conversion"}
# Sweep points per shape. A tile's union grows as about 16 + (Tk - 16) (1 - exp(-128 * 16 f / (Tk - 16))):
# with 32 blocks it is all of them by f = 0.03, with 256 blocks it reaches 150 near f = 0.1, so the
# points sit where the union moves.
SWEEP_F = {"sweep16": [0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.2, 1.0],
           "sweeplong": [0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 1.0]}
SWEEP_F_QUICK = {"sweep16": [0.0, 0.002, 0.01, 1.0], "sweeplong": [0.0, 0.05, 0.2, 1.0]}
# (name, B, Hq, Hkv, Lq, Lk) of docs/design.md §7; the sweeps run on the two query shapes, tile16 at Lk = 16K.
SHAPES = {"query16of32": ("query16of32", 8, 16, 1, 4096, 4096),
          "query-long": ("query-long", 1, 32, 8, 32768, 32768),
          "tile16": ("tile16", 2, 16, 1, 4096, 16384)}

try:
    import torch
except ImportError:  # argument checks and --markdown run without torch
    torch = None


# ---- ours ------------------------------------------------------------------------------------------

class Problem:
    """Shapes of one run: q [B, Lq, Hq, D], k, v [B, Lk, Hkv, D], lists [B, Hkv, Lq, K]."""

    def __init__(self, name, B, Hq, Hkv, Lq, Lk, D=128, K=16):
        self.name, self.B, self.Hq, self.Hkv, self.Lq, self.Lk, self.D, self.K = name, B, Hq, Hkv, Lq, Lk, D, K
        self.Tq, self.Tk, self.group = -(-Lq // BLOCK), -(-Lk // BLOCK), Hq // Hkv

    def shape(self):
        return dict(B=self.B, Hq=self.Hq, Hkv=self.Hkv, Lq=self.Lq, Lk=self.Lk, D=self.D, K=self.K, causal=False)

    def problem_shape(self, sa):
        return sa.ProblemShape(self.B, self.Lq, self.Lk, self.Hq, self.Hkv, self.D, False)


class Ours:
    """Every schedule of the library on one problem's tensors, through the sparse_attn package; each call
    launches on torch's current stream and writes into tensors allocated once."""

    def __init__(self, sa, pb, q, k, v, lists, merge_window=0):
        import torch
        self.sa, self.pb, self.q, self.k, self.v, self.lists = sa, pb, q, k, v, lists
        self.merge_window = merge_window
        self.shape = pb.problem_shape(sa)
        self.out = torch.empty_like(q)
        self.tidx = torch.zeros(pb.B, pb.Hkv, pb.Tq, pb.Tk, device=q.device, dtype=torch.int32)
        self.tcnt = torch.zeros(pb.B, pb.Hkv, pb.Tq, device=q.device, dtype=torch.int32)

    def query_sparse(self, schedule, partials="f32", trusted=True):
        return self.sa.query_sparse(self.q, self.k, self.v, self.lists, partials=partials, schedule=schedule,
                                    trusted=trusted, merge_window=self.merge_window, out=self.out)

    def convert_host(self):
        """The conversion on the host: the lists to the host, TileLists back (synchronises)."""
        idx, cnt = self.sa.query_lists_to_tile_lists(self.lists.cpu(), self.shape, kmax=self.pb.Tk)
        self.tidx.copy_(idx)
        self.tcnt.copy_(cnt)

    def convert_device(self, trusted=True):
        """The library's conversion on the device into tidx (Kmax = Tk: room for any union, as a trusted
        conversion requires) and tcnt; trusted, it is one launch without synchronisation."""
        self.sa.query_lists_to_tile_lists(self.lists, self.shape, kmax=self.pb.Tk, trusted=trusted,
                                          out=(self.tidx, self.tcnt))

    def tile_sparse(self, trusted=True):
        return self.sa.tile_sparse(self.q, self.k, self.v, self.tidx, self.tcnt, trusted=trusted, out=self.out)

    def dense(self):
        return self.sa.dense(self.q, self.k, self.v, out=self.out)


def plan(sa, pb, lists, partials="f32", merge_window=0):
    """The planner's choice, estimates (finite ones), merge window, reason and selection statistics."""
    p = sa.plan_schedule(lists, pb.problem_shape(sa), partials=partials, merge_window=merge_window)
    est = {"q_centric": p["q_centric_ms"], "kv_centric": p["kv_centric_ms"]}
    if math.isfinite(p["group_centric_ms"]):
        est["group_centric"] = p["group_centric_ms"]
    return {"choice": p["schedule"], "reason": p["reason"], "est_ms": est, "merge_window": p["merge_window"],
            "stats": p["stats"]}


# ---- selections ------------------------------------------------------------------------------------

def overlap_lists(pb, f, gen, device):
    """int32 [B, Hkv, Lq, K]: per (b, g, Q tile) a base list of K distinct blocks; each query keeps each
    base block with probability 1 - f and fills its other slots with distinct blocks drawn uniformly
    from those it did not keep. f = 0: every query holds its tile's list; f = 1: independent lists."""
    B, G, Lq, Tq, Tk, K = pb.B, pb.Hkv, pb.Lq, pb.Tq, pb.Tk, pb.K
    if K > Tk:
        raise ValueError(f"{pb.name}: K = {K} blocks per query exceed the {Tk} KV blocks")
    nq = B * G * Lq
    base = torch.rand(B * G * Tq, Tk, generator=gen, device=device).topk(K, dim=1).indices  # [tiles, K]
    tile_of = (torch.arange(nq, device=device) // Lq) * Tq + (torch.arange(nq, device=device) % Lq) // BLOCK
    base_q = base[tile_of]                                              # [nq, K]
    kept = torch.rand(nq, K, generator=gen, device=device) >= f
    scores = torch.rand(nq, Tk, generator=gen, device=device)
    # Kept blocks score above every draw, so top-K takes all of them and fills up with random others.
    scores.scatter_(1, base_q, torch.where(kept, 2.0, scores.gather(1, base_q)))
    idx = scores.topk(K, dim=1).indices.to(torch.int32)
    return idx.view(B, G, Lq, K).contiguous()


def tile_pattern_lists(pb, pattern, gen):
    """The tile16 patterns (harness.tile_lists) as QueryLists: every query of a tile holds the tile's list."""
    tiles, _ = harness.tile_lists(pb.B, pb.Hkv, pb.Tq, pb.Tk, pb.K, pattern, gen)
    rows = torch.arange(pb.Lq, device=gen.device) // BLOCK
    return tiles[:, :, rows].contiguous()


def block_table(lists, pb):
    """bool [B, Hkv, Lq, Tk]: table[b, g, i, j] iff query i of group g selected block j (-1 slots ignored)."""
    valid = lists >= 0
    t = torch.zeros(pb.B, pb.Hkv, pb.Lq, pb.Tk, dtype=torch.int8, device=lists.device)
    t.scatter_add_(3, lists.long().clamp(min=0), valid.to(torch.int8))
    return t > 0


def tile_counts(table, pb):
    """int32 [B, Hkv, Tq, Tk]: how many queries of each Q tile selected each block."""
    pad = pb.Tq * BLOCK - pb.Lq
    t = table if pad == 0 else torch.nn.functional.pad(table, (0, 0, 0, pad))
    return t.view(pb.B, pb.Hkv, pb.Tq, BLOCK, pb.Tk).sum(3, dtype=torch.int32)


def union_tile_lists(lists, pb):
    """The tiles' unions as TileLists (idx [B, Hkv, Tq, Tk] ascending, then -1 as the library pads;
    cnt [B, Hkv, Tq]) formed on the lists' device."""
    union = tile_counts(block_table(lists, pb), pb) > 0
    ar = torch.arange(pb.Tk, device=lists.device, dtype=torch.int32)
    keyed = torch.where(union, ar, ar + pb.Tk).sort(dim=3).values
    idx = torch.where(keyed < pb.Tk, keyed, -1).to(torch.int32).contiguous()
    return idx, union.sum(3, dtype=torch.int32).contiguous()


def tile_rows(pb):
    """Queries per Q tile (the last may be partial)."""
    return torch.clamp(pb.Lq - torch.arange(pb.Tq) * BLOCK, max=BLOCK)


def flex_block_mask(table, pb):
    """The BlockMask that create_block_mask builds for the mask_mod reading `table`, formed from the
    per-tile counts instead of evaluating the mask at every (query, key): a block chosen by every query
    of its tile is full, one chosen by some is partial (mask_mod applied). H = 1 when Hkv = 1, else Hq."""
    from torch.nn.attention.flex_attention import BlockMask
    counts = tile_counts(table, pb)
    rows = tile_rows(pb).to(counts.device).view(1, 1, pb.Tq, 1)
    full = counts == rows
    partial = (counts > 0) & ~full

    def to_blocks(m):
        num = m.sum(3, dtype=torch.int32)
        idx = torch.sort((~m).to(torch.int8), dim=3, stable=True).indices.to(torch.int32)
        if pb.Hkv > 1:
            num, idx = num.repeat_interleave(pb.group, dim=1), idx.repeat_interleave(pb.group, dim=1)
        return num.contiguous(), idx.contiguous()

    kv_num, kv_idx = to_blocks(partial)
    full_num, full_idx = to_blocks(full)
    mask_mod = table_mask_mod(table, pb)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(pb.Lq, pb.Lk))


def table_mask_mod(table, pb):
    group = pb.group

    def mask_mod(b, h, q_idx, kv_idx):
        return table[b, h // group, q_idx, kv_idx // BLOCK]
    return mask_mod


def same_block_mask(a, b):
    """Equal kv/full block counts and equal block sets (order inside a row is free)."""
    def sets(num, idx):
        n = num.unsqueeze(-1)
        ar = torch.arange(idx.shape[-1], device=idx.device)
        return torch.where(ar < n, idx, -1).sort(dim=-1).values

    def full(m):  # a mask without full blocks may carry None
        if m.full_kv_num_blocks is None:
            return torch.zeros_like(m.kv_num_blocks), torch.zeros_like(m.kv_indices)
        return m.full_kv_num_blocks, m.full_kv_indices

    for (xn, xi), (yn, yi) in (((a.kv_num_blocks, a.kv_indices), (b.kv_num_blocks, b.kv_indices)), (full(a), full(b))):
        if xn.shape != yn.shape or xi.shape != yi.shape or not torch.equal(xn, yn):
            return False
        if not torch.equal(sets(xn, xi), sets(yn, yi)):
            return False
    return True


# ---- verification ----------------------------------------------------------------------------------

def blocks_to_keys(allowed, Lk):
    """bool [n, Tk] blocks -> bool [n, Lk] keys."""
    return allowed.repeat_interleave(BLOCK, dim=1)[:, :Lk]


class Checker:
    """harness.verify_rows for the per-query semantics ('query': each query sees its own blocks) and for
    the tiles' unions ('union': each query sees every block its tile's queries chose)."""

    def __init__(self, pb, q, k, v, lists, gen):
        self.pb, self.q, self.k, self.v, self.gen = pb, q, k, v, gen
        self.table = block_table(lists, pb)
        self.union = tile_counts(self.table, pb) > 0

    def keymask(self, semantics, b, h, rows):
        g = h // self.pb.group
        if semantics == "dense":
            return torch.ones(len(rows), self.pb.Lk, dtype=torch.bool, device=self.q.device)
        if semantics == "query":
            allowed = self.table[b, g][rows.to(self.table.device)]
        else:
            allowed = self.union[b, g][(rows // BLOCK).to(self.union.device)]
        return blocks_to_keys(allowed, self.pb.Lk)

    def check(self, out, semantics="query"):
        """out [B, Lq, Hq, D] fully written (finite) and within the docs/design.md §6 bounds on sampled rows."""
        return harness.verify_rows(out, self.q, self.k, self.v,
                                   lambda b, h, rows: self.keymask(semantics, b, h, rows), self.gen)


# ---- one configuration: verify, then time --------------------------------------------------------

def run_config(ctx, pb, lists, label, q, k, v, peers=False, bf16_partials=False, host=True):
    """Verifies and times every schedule of ours (and the peers if asked) on `lists`; returns a row."""
    timer = ctx.timer
    row = {"label": label, "shape": pb.shape(), "times_ms": {}, "verify": {}, "errors": {}}
    row["plan"] = plan(ctx.sa, pb, lists, merge_window=ctx.merge_window)
    st = row["plan"]["stats"]
    useful = 4.0 * pb.D * pb.group * st["selected_pairs"]
    row["useful_gflop"] = useful / 1e9
    checker = Checker(pb, q, k, v, lists, ctx.cpu_gen)
    ours = Ours(ctx.sa, pb, q, k, v, lists, ctx.merge_window)
    outs = {}

    def attempt(name, verify_call, semantics, time_call):
        try:
            harness.poisoned(verify_call, ours.out)
            row["verify"][name] = checker.check(ours.out, semantics)
            outs[name] = ours.out.clone()
            if not row["verify"][name]["ok"]:
                print(f"  VERIFY FAILED {label} {name}: {row['verify'][name]}", flush=True)
            if time_call is not None:
                row["times_ms"][name] = timer(time_call)
        except Exception as e:  # a schedule the library lacks, or a failure, is reported, not fatal
            row["errors"][name] = harness.short_error(e, 400)

    attempt("kv_centric", lambda: ours.query_sparse("kv_centric", trusted=False), "query",
            lambda: ours.query_sparse("kv_centric"))
    if "kv_centric" in outs:
        again = harness.poisoned(lambda: ours.query_sparse("kv_centric"), ours.out)
        row["kv_centric_bitwise_repeat"] = bool(torch.equal(again, outs["kv_centric"]))
    if bf16_partials:
        attempt("kv_centric_bf16", lambda: ours.query_sparse("kv_centric", partials="bf16", trusted=False),
                "query", lambda: ours.query_sparse("kv_centric", partials="bf16"))
    attempt("group_centric", lambda: ours.query_sparse("group_centric", trusted=False), "query",
            lambda: ours.query_sparse("group_centric"))

    # Q-centric as the library runs it: the conversion on the device, then tile_sparse; both validate
    # in the verified call and are trusted when timed (as kv_centric is).
    def convert_and_run():
        ours.convert_device()
        return ours.tile_sparse()

    attempt("q_centric", lambda: (ours.convert_device(trusted=False), ours.tile_sparse(trusted=False))[1],
            "union", convert_and_run)
    if "q_centric" in outs:
        ref_idx, ref_cnt = union_tile_lists(lists, pb)
        row["conversion_equals_torch_union"] = bool(torch.equal(ours.tidx, ref_idx) and
                                                    torch.equal(ours.tcnt, ref_cnt))
        if not row["conversion_equals_torch_union"]:
            print(f"  VERIFY FAILED {label}: device conversion differs from the torch union", flush=True)
        attempt("q_centric_tile_only", ours.tile_sparse, "union", ours.tile_sparse)
        try:
            row["times_ms"]["q_centric_conversion"] = timer(ours.convert_device)
        except Exception as e:
            row["errors"]["q_centric_conversion"] = str(e)[:400]

    if host:
        def host_convert_and_run():
            ours.convert_host()
            return ours.tile_sparse()

        attempt("q_centric_host", lambda: (ours.convert_host(), ours.tile_sparse(trusted=False))[1], "union",
                host_convert_and_run)
        if "q_centric_host" in outs:
            try:
                row["times_ms"]["q_centric_host_conversion"] = timer(ours.convert_host)
            except Exception as e:
                row["errors"]["q_centric_host_conversion"] = str(e)[:400]

    if peers:
        run_peers(ctx, pb, q, k, v, lists, ours, row, outs, checker)

    # Implementations with the same semantics, compared on the whole output.
    cross = {}
    for a, b in (("kv_centric", "group_centric"), ("kv_centric", "kv_centric_bf16"), ("kv_centric", "flex"),
                 ("q_centric", "q_centric_host")):
        if a in outs and b in outs:
            cross[f"{a}~{b}"] = harness.err_pair(outs[b], outs[a])[0]
    row["cross_relerr"] = cross
    for name, t in row["times_ms"].items():
        row.setdefault("useful_tflops", {})[name] = useful / t / 1e9 if t > 0 else None
    return row


def run_peers(ctx, pb, q, k, v, lists, ours, row, outs, checker):
    timer = ctx.timer
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # Dense: ours (checked against the reference), then the dense peers, each against ours on the whole output.
    try:
        dense_ref = harness.poisoned(ours.dense, ours.out).clone()
        row["verify"]["dense"] = checker.check(dense_ref, "dense")
        row["times_ms"]["dense_ours"] = timer(ours.dense)
    except Exception as e:
        dense_ref = None
        row["errors"]["dense_ours"] = harness.short_error(e, 400)
    for name, make in ctx.peers.dense(q, k, v, False):
        key = {"cudnn": "sdpa_cudnn", "flash": "sdpa_flash"}.get(name, name + "_dense")
        try:
            run = make()
            o = run()
            torch.cuda.synchronize()
            if dense_ref is not None:
                row["verify"][key] = {"relerr_vs_dense_ours": harness.err_pair(o, dense_ref)[0]}
            row["times_ms"][key] = timer(run)
            if pb.group > 1 and hasattr(run, "gqa"):
                row.setdefault("sdpa_gqa", {})[key] = run.gqa
        except Exception as e:  # a backend that refuses the shape is reported, not fatal
            row["errors"][key] = harness.short_error(e)
    if ctx.peers.flex is None:
        return
    try:
        from torch.nn.attention.flex_attention import create_block_mask
        table = block_table(lists, pb)
        t0 = time.time()
        bm = flex_block_mask(table, pb)
        row["flex_block_mask_s"] = time.time() - t0
        if pb.Hkv == 1 and pb.B * pb.Lq * pb.Lk <= (1 << 28):
            # On a shape where evaluating the mask everywhere is affordable, the counts-built mask must
            # equal create_block_mask's.
            cbm = create_block_mask(table_mask_mod(table, pb), pb.B, 1, pb.Lq, pb.Lk, device=q.device,
                                    BLOCK_SIZE=BLOCK)
            row["flex_block_mask_equals_create_block_mask"] = bool(same_block_mask(bm, cbm))
        t0 = time.time()
        run = lambda: ctx.peers.flex(qt, kt, vt, block_mask=bm, enable_gqa=pb.group > 1)
        o = run().transpose(1, 2)
        torch.cuda.synchronize()
        row["flex_compile_and_first_call_s"] = time.time() - t0
        o = o.contiguous()
        row["verify"]["flex"] = checker.check(o, "query")
        outs["flex"] = o
        row["times_ms"]["flex"] = timer(run)
    except Exception as e:
        row["errors"]["flex"] = harness.short_error(e, 400)


# ---- planner check and crossover -----------------------------------------------------------------

MEASURED_FOR = {"q_centric": "q_centric", "kv_centric": "kv_centric", "group_centric": "group_centric"}


def judge(row):
    """The planner's choice against the fastest measured schedule, with Q-centric counted as the library
    runs it (device conversion + tile_sparse) and as tile_sparse alone (a free conversion)."""
    t = row["times_ms"]
    out = {"label": row["label"], "choice": row["plan"]["choice"], "est_ms": row["plan"]["est_ms"]}
    for variant, qkey in (("library", "q_centric"), ("tile_only", "q_centric_tile_only")):
        every = {"q_centric": t.get(qkey), "kv_centric": t.get("kv_centric"), "group_centric": t.get("group_centric")}
        every = {k: v for k, v in every.items() if v is not None}
        # Judged among the schedules the planner estimates; a faster one it does not know is noted apart.
        cands = {k: v for k, v in every.items() if k in row["plan"]["est_ms"]}
        if not cands:
            continue
        best = min(cands, key=cands.get)
        chosen_t = cands.get(row["plan"]["choice"])
        out[variant] = {"measured_ms": every, "fastest": best, "fastest_overall": min(every, key=every.get),
                        "right": row["plan"]["choice"] == best,
                        "cost_of_choice": (chosen_t / cands[best]) if chosen_t else None}
    return out


def crossover(points, a, b, times=lambda p: p["times_ms"]):
    """f where schedules a and b take equal time, by linear interpolation of ln(t_a / t_b) between the
    neighbouring sweep points whose winner differs; None when one schedule wins everywhere."""
    pts = [(p["f"], times(p).get(a), times(p).get(b)) for p in points]
    pts = [(f, x, y) for f, x, y in pts if x and y and math.isfinite(x) and math.isfinite(y)]
    found = []
    for (f0, a0, b0), (f1, a1, b1) in zip(pts, pts[1:]):
        r0, r1 = math.log(a0 / b0), math.log(a1 / b1)
        if r0 == 0.0:
            found.append(f0)
        elif r0 * r1 < 0:
            found.append(f0 + (f1 - f0) * r0 / (r0 - r1))
    return found or None


# ---- main ------------------------------------------------------------------------------------------

class Context:
    pass


def interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def fmt(x, w=8, p=3):
    return f"{x:{w}.{p}f}" if isinstance(x, (int, float)) and math.isfinite(x) else f"{'-':>{w}}"


def print_summary(res):
    print("\n==== query schedules (ms; speed-up over SDPA cuDNN dense) ====")
    for r in res["workloads"]:
        t = r["times_ms"]
        dense = t.get("sdpa_cudnn")
        print(f"{r['label']}: union/tile {r['plan']['stats']['union_per_tile']:.1f}, "
              f"overlap {r['plan']['stats']['neighbour_overlap']:.3f}")
        for name in sorted(t, key=t.get):
            sp = f" x{dense / t[name]:.2f}" if dense and name not in PARTIAL_TIMES else ""
            ok = r["verify"].get(name, {}).get("ok")
            v = "" if ok is None else (" ok" if ok else " VERIFY-FAILED")
            print(f"  {name:26s} {t[name]:9.3f} ms{sp}{v}")
        for name, e in r["errors"].items():
            print(f"  {name:26s} ERROR: {e[:160]}")
    if res["sweep"]:
        print("\n==== overlap sweep (ms) ====")
        print(f"{'shape':12s} {'f':>6s} {'overlap':>7s} {'union':>6s} | {'q':>8s} {'q_tile':>8s} {'kv':>8s} "
              f"{'group':>8s} | {'est_q':>8s} {'est_kv':>8s} {'est_grp':>8s} | pick / fastest")
        for p in res["sweep"]:
            t, e, st = p["times_ms"], p["plan"]["est_ms"], p["plan"]["stats"]
            j = p["judge"].get("library", {})
            print(f"{p['shape_name']:12s} {p['f']:6.3f} {st['neighbour_overlap']:7.3f} {st['union_per_tile']:6.1f} | "
                  f"{fmt(t.get('q_centric'))} {fmt(t.get('q_centric_tile_only'))} {fmt(t.get('kv_centric'))} "
                  f"{fmt(t.get('group_centric'))} | {fmt(e.get('q_centric'))} {fmt(e.get('kv_centric'))} "
                  f"{fmt(e.get('group_centric'))} | {p['plan']['choice']} / {j.get('fastest', '-')}")
        for c in res["crossovers"]:
            print(f"crossover {c['shape_name']} {c['a']} vs {c['b']} ({c['basis']}): f = {c['f']}")
    if res["planner_check"]:
        print("\n==== planner check ====")
        print(f"{'configuration':34s} {'pick':14s} {'fastest(lib)':14s} {'ok':>3s} {'cost':>6s} | "
              f"{'fastest(tile)':14s} {'ok':>3s} {'cost':>6s}")
        n = {"library": [0, 0], "tile_only": [0, 0]}
        for c in res["planner_check"]:
            cells = []
            for variant in ("library", "tile_only"):
                j = c.get(variant)
                if j is None:
                    cells.append(f"{'-':14s} {'-':>3s} {'-':>6s}")
                    continue
                n[variant][0] += int(j["right"])
                n[variant][1] += 1
                cost = f"{j['cost_of_choice']:.2f}" if j["cost_of_choice"] else "-"
                star = "*" if j["fastest_overall"] != j["fastest"] else ""
                cells.append(f"{j['fastest'] + star:14s} {'yes' if j['right'] else 'NO':>3s} {cost:>6s}")
            print(f"{c['label'][:34]:34s} {c['choice']:14s} {cells[0]} | {cells[1]}")
        for variant, (a, b) in n.items():
            print(f"planner right ({variant}): {a} of {b}")
        print("(* a schedule the planner does not estimate was faster still)")
    bad = [(r["label"], k) for r in res["workloads"] + res["sweep"] for k, v in r["verify"].items()
           if isinstance(v, dict) and v.get("ok") is False]
    bad += [(r["label"], "q_centric_conversion") for r in res["workloads"] + res["sweep"]
            if r.get("conversion_equals_torch_union") is False]
    print(f"\nverification: {'all passed' if not bad else 'FAILED ' + str(bad)}; parts run: {res['parts_done']}; "
          f"parts skipped: {res['parts_skipped']}; {res['elapsed_s']:.0f} s")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_args(ap)
    ap.add_argument("--print-json", action="store_true", help="also print the JSON (between JSON-BEGIN/END lines)")
    ap.add_argument("--parts", default=",".join(ALL_PARTS), help="comma list of " + ",".join(ALL_PARTS))
    ap.add_argument("--no-host", action="store_true", help="skip q_centric_host (the conversion on the host)")
    ap.add_argument("--sweep-f", help="comma list of overlap fractions f (default depends on --quick)")
    ap.add_argument("--merge-window", type=int, default=0,
                    help="query_sparse's merge_window for the KV-centric calls and the planner (0: automatic)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip parts that start after this many seconds")
    ap.add_argument("--selftest", action="store_true", help="CPU checks of the generators and the block mask")
    ap.add_argument("--markdown", nargs="+", metavar="JSON",
                    help="print the tables of saved results (this script's JSON, or a stage log holding "
                         "JSON-BEGIN/END blocks) as markdown, and nothing else")
    args = harness.parse(ap, argv)
    args.part_list = [p for p in args.parts.split(",") if p]
    for p in args.part_list:
        if p not in ALL_PARTS:
            ap.error(f"--parts: unknown part {p!r} (known: {', '.join(ALL_PARTS)})")
    if args.sweep_f:
        try:
            given = [float(x) for x in args.sweep_f.split(",")]
        except ValueError:
            ap.error(f"--sweep-f: expected comma-separated numbers, got {args.sweep_f!r}")
        bad_f = [f for f in given if not 0.0 <= f <= 1.0]
        if bad_f:
            ap.error(f"--sweep-f: fractions must lie in [0, 1], got {bad_f}")
        args.sweep_points = {"sweep16": given, "sweeplong": given}
    else:
        args.sweep_points = SWEEP_F_QUICK if args.quick else SWEEP_F
    if not 0 <= args.merge_window <= 8:
        ap.error(f"--merge-window must lie in [0, 8], got {args.merge_window}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.markdown:
        return markdown(args.markdown)
    if torch is None:
        raise SystemExit("bench_query.py needs torch (and, except for --selftest, a CUDA device)")
    if args.selftest:
        return selftest()
    _, sa = harness.gpu_modules()
    parts, sweep_f = args.part_list, args.sweep_points

    start = time.time()
    signal.signal(signal.SIGTERM, interrupted)  # a stage timeout still gets the JSON and the summary
    ctx = Context()
    ctx.sa, ctx.merge_window = sa, args.merge_window
    ctx.timer = harness.Timer(args)
    ctx.peers = harness.Peers(enabled=not args.no_peers)
    ctx.cpu_gen = torch.Generator().manual_seed(args.seed + 1)
    gen = harness.generator(args.seed)
    res = {"meta": harness.run_meta(args, peers=ctx.peers.status, timer=ctx.timer.method, sweep_f=sweep_f,
                                    merge_window=args.merge_window,
                                    useful_flops="4 * D * Hq/Hkv * selected visible (b, group, query, key) pairs"),
           "workloads": [], "sweep": [], "planner_check": [], "crossovers": [], "parts_done": [], "parts_skipped": []}

    def inputs(pb):
        return harness.random_qkv(pb.B, pb.Lq, pb.Lk, pb.Hq, pb.Hkv, pb.D, gen)

    def save():
        res["elapsed_s"] = time.time() - start
        if args.json:
            harness.write_json(args.json, res)

    def record_check(row):
        res["planner_check"].append(judge(row))

    q16, qlong = Problem(*SHAPES["query16of32"]), Problem(*SHAPES["query-long"])
    try:
        for part in parts:
            if args.budget_s and time.time() - start > args.budget_s:
                res["parts_skipped"].append(part)
                continue
            t0 = time.time()
            if part in ("query16of32", "query-long"):
                pb = q16 if part == "query16of32" else qlong
                q, k, v = inputs(pb)
                lists = overlap_lists(pb, 1.0, gen, DEVICE)
                row = run_config(ctx, pb, lists, pb.name, q, k, v, peers=True, bf16_partials=True,
                                 host=not args.no_host)
                print(f"  {row['label']}: " + ", ".join(f"{n} {t:.3f}" for n, t in row["times_ms"].items()), flush=True)
                res["workloads"].append(row)
                record_check(row)
                del q, k, v, lists
            elif part == "tile16":
                pb = Problem(*SHAPES["tile16"])
                q, k, v = inputs(pb)
                for pattern in ("independent", "pairs"):
                    lists = tile_pattern_lists(pb, pattern, gen)
                    row = run_config(ctx, pb, lists, f"tile16 {pattern} Lk={pb.Lk}", q, k, v, host=not args.no_host)
                    res["workloads"].append(row)
                    record_check(row)
                del q, k, v
            else:
                pb = q16 if part == "sweep16" else qlong
                q, k, v = inputs(pb)
                for f in sweep_f[part]:
                    if args.budget_s and time.time() - start > args.budget_s:
                        res["parts_skipped"].append(f"{part} f={f}")
                        continue
                    lists = overlap_lists(pb, f, gen, DEVICE)
                    row = run_config(ctx, pb, lists, f"sweep {pb.name} f={f}", q, k, v, host=not args.no_host)
                    row["f"], row["shape_name"] = f, pb.name
                    row["judge"] = judge(row)
                    res["sweep"].append(row)
                    res["planner_check"].append(row["judge"])
                    print(f"  {row['label']}: " + ", ".join(f"{n} {t:.3f}" for n, t in row["times_ms"].items()),
                          flush=True)
                del q, k, v
            res["parts_done"].append(part)
            print(f"[{part}] {time.time() - t0:.1f} s", flush=True)
            torch.cuda.empty_cache()
            save()
    except KeyboardInterrupt:
        res["parts_skipped"].append("interrupted")
    finally:
        for shape_name in sorted({p["shape_name"] for p in res["sweep"]}):
            pts = sorted((p for p in res["sweep"] if p["shape_name"] == shape_name), key=lambda p: p["f"])
            for a, b in (("q_centric", "kv_centric"), ("q_centric_tile_only", "kv_centric"),
                         ("q_centric", "group_centric"), ("kv_centric", "group_centric")):
                res["crossovers"].append({"shape_name": shape_name, "a": a, "b": b, "basis": "measured",
                                          "f": crossover(pts, a, b)})
            for a, b in (("q_centric", "kv_centric"), ("q_centric", "group_centric")):
                res["crossovers"].append({"shape_name": shape_name, "a": a, "b": b, "basis": "planner estimate",
                                          "f": crossover(pts, a, b, times=lambda p: p["plan"]["est_ms"])})
        save()
        if args.print_json:
            print("JSON-BEGIN")
            print(json.dumps(res, separators=(",", ":")))
            print("JSON-END")
        print_summary(res)
    if ctx.peers.flex is not None:
        # torch.compile leaves a pool of compile workers whose shutdown at exit can wait minutes; every
        # result is written and printed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


# ---- markdown report of saved results --------------------------------------------------------------

def load_results(path):
    """Result dicts of a JSON file (one run, or {"runs": [...]}), or of every JSON-BEGIN/END block of a log."""
    with open(path) as fh:
        text = fh.read()
    if "JSON-BEGIN" not in text:
        data = json.loads(text)
        return data["runs"] if "runs" in data else [data]
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "JSON-BEGIN" and i + 1 < len(lines):
            out.append(json.loads(lines[i + 1]))
    return out


def markdown(paths):
    runs = [r for p in paths for r in load_results(p)]
    impl_order = ["kv_centric", "kv_centric_bf16", "kv_reverse_index", "kv_attention", "kv_combine", "group_centric",
                  "q_centric", "q_centric_conversion", "q_centric_tile_only", "q_centric_host",
                  "q_centric_host_conversion", "flex",
                  "dense_ours", "sdpa_cudnn", "sdpa_flash"]
    for run in runs:
        m = run["meta"]
        print(f"\nRun of {m['date']} on {m.get('device')} (torch {m.get('torch')}, CUDA {m.get('cuda')}, "
              f"cuDNN {m.get('cudnn')}, commit {m.get('git_commit')}); "
              f"{m['timing']}; command `{m['command']}`.")
        for r in run["workloads"]:
            t, ver, st = r["times_ms"], r["verify"], r["plan"]["stats"]
            dense = t.get("sdpa_cudnn")
            print(f"\n{r['label']} ({', '.join(f'{k}={v}' for k, v in r['shape'].items())}; union per tile "
                  f"{st['union_per_tile']:.1f}, neighbour overlap {st['neighbour_overlap']:.3f}):\n")
            print("| implementation | ms | x over cuDNN dense | useful TFLOP/s | check: relerr (plain bf16) |")
            print("| --- | ---: | ---: | ---: | --- |")
            for name in [n for n in impl_order if n in t] + [n for n in t if n not in impl_order]:
                v = ver.get(name, {})
                chk = (f"{'ok' if v['ok'] else 'FAILED'} {v['relerr']:.2e} ({v['plain_relerr']:.2e})" if "ok" in v
                       else (f"vs our dense {v['relerr_vs_dense_ours']:.2e}" if "relerr_vs_dense_ours" in v else ""))
                part = name in PARTIAL_TIMES  # a phase of a schedule: no speed-up or useful rate of its own
                sp = f"{dense / t[name]:.2f}" if dense and not part else "-"
                tf = None if part else r.get("useful_tflops", {}).get(name)
                gqa = f" ({r['sdpa_gqa'][name]} GQA)" if name in r.get("sdpa_gqa", {}) else ""
                print(f"| {name}{gqa} | {t[name]:.3f} | {sp} | {tf:.0f} | {chk} |" if tf else
                      f"| {name}{gqa} | {t[name]:.3f} | {sp} | - | {chk} |")
            for name, e in r["errors"].items():
                print(f"| {name} | error: {e[:150]} | | | |")
            extra = {k: r[k] for k in ("kv_centric_bitwise_repeat", "flex_block_mask_equals_create_block_mask",
                                       "conversion_equals_torch_union") if k in r}
            if extra or r.get("cross_relerr"):
                print(f"\n{extra} cross relerr: " + ", ".join(f"{k} {v:.2e}" for k, v in r["cross_relerr"].items()))
        if run["sweep"]:
            print("\nOverlap sweep (ms; est = planner estimate):\n")
            print("| shape | f | overlap | union/tile | q | q conversion | q tile | q host | kv | group | est q | est kv | "
                  "est group | pick | fastest |")
            print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
            for p in run["sweep"]:
                t, e, st = p["times_ms"], p["plan"]["est_ms"], p["plan"]["stats"]
                j = p["judge"].get("library", {})
                c = lambda d, k: f"{d[k]:.3f}" if k in d else "-"
                print(f"| {p['shape_name']} | {p['f']} | {st['neighbour_overlap']:.3f} | {st['union_per_tile']:.1f} | "
                      f"{c(t, 'q_centric')} | {c(t, 'q_centric_conversion')} | {c(t, 'q_centric_tile_only')} | "
                      f"{c(t, 'q_centric_host')} | "
                      f"{c(t, 'kv_centric')} | {c(t, 'group_centric')} | {c(e, 'q_centric')} | {c(e, 'kv_centric')} | "
                      f"{c(e, 'group_centric')} | {p['plan']['choice']} | {j.get('fastest', '-')} |")
            print()
            for x in run["crossovers"]:
                if x["f"]:
                    print(f"- crossover {x['shape_name']}, {x['a']} vs {x['b']} ({x['basis']}): f = "
                          + ", ".join(f"{f:.3f}" for f in x["f"]))
        if run["planner_check"]:
            print("\nPlanner check (fastest among the schedules the planner estimates; * = an unestimated one was "
                  "faster still):\n")
            print("| configuration | pick | fastest (library Q-centric, device conversion) | right | cost of pick | "
                  "fastest (tile_sparse "
                  "alone) | right | cost of pick |")
            print("| --- | --- | --- | --- | ---: | --- | --- | ---: |")
            for c in run["planner_check"]:
                cells = []
                for variant in ("library", "tile_only"):
                    j = c.get(variant)
                    if j is None:
                        cells.append("- | - | -")
                        continue
                    star = "*" if j["fastest_overall"] != j["fastest"] else ""
                    cost = f"{j['cost_of_choice']:.2f}" if j["cost_of_choice"] else "-"
                    cells.append(f"{j['fastest']}{star} | {'yes' if j['right'] else 'no'} | {cost}")
                print(f"| {c['label']} | {c['choice']} | {cells[0]} | {cells[1]} |")
        rows = run["workloads"] + run["sweep"]
        if rows:
            print("\nData for the cost model (per configuration: counts from selection_stats, measured ms, and the "
                  "per-unit times they imply):\n")
            print("| configuration | group | tiles | tile_union | query_blocks | group_cta_union | conversion ms | "
                  "q_centric - tile_sparse ms | tile_sparse ms | ns per (head, tile, block) visit | kv ms | "
                  "ns per (query, head, slot) row | group-centric ms |")
            print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
            for r in rows:
                st, t = r["plan"]["stats"], r["times_ms"]
                g = r["shape"]["Hq"] // r["shape"]["Hkv"]
                visits, rws = st["tile_union"] * g, st["query_blocks"] * g
                tq, kv, qc = t.get("q_centric_tile_only"), t.get("kv_centric"), t.get("q_centric")
                print(f"| {r['label']} | {g} | {st['tiles']:.0f} | {st['tile_union']:.0f} | {st['query_blocks']:.0f} | "
                      f"{fmt(st.get('group_cta_union'), 0, 0).strip()} | "
                      f"{fmt(t.get('q_centric_conversion'), 0, 4).strip()} | "
                      f"{fmt(qc - tq if qc and tq else None, 0, 4).strip()} | "
                      f"{fmt(tq, 0).strip()} | {fmt(tq * 1e6 / visits if tq else None, 0, 2).strip()} | "
                      f"{fmt(kv, 0).strip()} | {fmt(kv * 1e6 / rws if kv else None, 0, 3).strip()} | "
                      f"{fmt(t.get('group_centric'), 0).strip()} |")
    return 0


# ---- CPU self-test ---------------------------------------------------------------------------------

def selftest():
    """Checks what runs without the GPU: the list generators, the union, the counts-built BlockMask
    against create_block_mask and the flex output against the reference (eager, CPU), on small shapes."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    gen = torch.Generator().manual_seed(3)
    failures = 0

    def expect(cond, what):
        nonlocal failures
        print(("ok   " if cond else "FAIL ") + what)
        failures += 0 if cond else 1

    pb = Problem("small", 2, 4, 2, 1013, 1100, D=64, K=4)  # partial last tile and block, GQA 2
    prev_union = -1.0
    for f in (0.0, 0.3, 1.0):
        lists = overlap_lists(pb, f, gen, "cpu")
        srt = lists.sort(dim=3).values
        expect(bool((lists >= 0).all() and (lists < pb.Tk).all()), f"f={f}: ids in range")
        expect(bool((srt[..., 1:] != srt[..., :-1]).all()), f"f={f}: ids distinct in every row")
        idx, cnt = union_tile_lists(lists, pb)
        table = block_table(lists, pb)
        ok = True
        for b in range(pb.B):
            for g in range(pb.Hkv):
                for t in range(pb.Tq):
                    u = sorted(set(lists[b, g, t * BLOCK:(t + 1) * BLOCK].flatten().tolist()))
                    ok &= cnt[b, g, t].item() == len(u) and idx[b, g, t, :len(u)].tolist() == u \
                        and bool((idx[b, g, t, len(u):] == -1).all())
        expect(ok, f"f={f}: union per tile equals the set union, ascending, -1 after")
        union = cnt.float().mean().item()
        expect(union >= prev_union, f"f={f}: mean union {union:.1f} does not shrink as f grows")
        prev_union = union
        if f == 0.0:
            expect(union == pb.K, "f=0: every tile's union is its base list")
        expect(bool(table.sum(3).eq(pb.K).all()), f"f={f}: the table holds K blocks per query")
    for pattern in ("independent", "pairs"):
        lists = tile_pattern_lists(Problem("t", 1, 2, 1, 512, 2048, D=64, K=4), pattern, gen)
        same_tile = bool((lists[:, :, 1:128] == lists[:, :, :1]).all())
        pairs = bool((lists[:, :, 128] == lists[:, :, 0]).all())
        expect(same_tile and (pairs == (pattern == "pairs")), f"tile16 {pattern}: one list per tile, pairs shared")

    for pb in (Problem("gqa", 1, 4, 2, 384, 512, D=64, K=2), Problem("mha1", 2, 2, 1, 256, 640, D=64, K=3)):
        lists = overlap_lists(pb, 0.2, gen, "cpu")
        table = block_table(lists, pb)
        bm = flex_block_mask(table, pb)
        H = 1 if pb.Hkv == 1 else pb.Hq
        cbm = create_block_mask(table_mask_mod(table, pb), pb.B, H, pb.Lq, pb.Lk, device="cpu", BLOCK_SIZE=BLOCK)
        expect(same_block_mask(bm, cbm), f"{pb.name}: counts-built BlockMask equals create_block_mask")
        other = flex_block_mask(block_table(overlap_lists(pb, 0.0, gen, "cpu"), pb), pb)
        expect(not same_block_mask(bm, other), f"{pb.name}: the comparison tells another selection's mask apart")
        q = torch.randn(pb.B, pb.Lq, pb.Hq, pb.D, generator=gen)
        k = torch.randn(pb.B, pb.Lk, pb.Hkv, pb.D, generator=gen)
        v = torch.randn(pb.B, pb.Lk, pb.Hkv, pb.D, generator=gen)
        o = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm,
                           enable_gqa=pb.group > 1).transpose(1, 2)
        rows = torch.arange(pb.Lq)
        worst = 0.0
        for b in range(pb.B):
            for h in range(pb.Hq):
                keys = blocks_to_keys(table[b, h // pb.group], pb.Lk)
                ref, _ = harness.attention_rows(q, k, v, b, h, rows, keys)
                worst = max(worst, harness.err_pair(o[b, :, h], ref)[0])
        expect(worst < 1e-5, f"{pb.name}: eager flex with the mask equals the float64 reference ({worst:.1e})")

    rows = [{"f": 0.0, "times_ms": {"a": 1.0, "b": 2.0}}, {"f": 0.5, "times_ms": {"a": 3.0, "b": 1.5}}]
    c = crossover(rows, "a", "b")
    expect(c is not None and abs(c[0] - 0.5 * math.log(2) / (math.log(2) + math.log(2))) < 1e-12,
           f"crossover interpolates ln(t_a / t_b): {c}")
    print(f"{'selftest passed' if failures == 0 else f'selftest: {failures} FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
