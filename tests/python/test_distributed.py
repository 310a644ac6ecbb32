"""sparse_attn.distributed on the CPU: the planner (partition, balance, byte counts against a direct
count) in this process, and the context-parallel operators on 2 and 4 gloo processes against the
single-process operator on the same global tensors.

Bounds: the "kv" strategy runs the operator on each rank's own rows over the same blocks in the same
order as one process does, so its out and lse must be bitwise equal to the single-process ones. The
"partials" strategy splits each row's softmax by rank and merges the partials in float32; its error
against the single-process result is bounded by 1e-5 relative (float32; 4e-3 for bfloat16, whose
partial outputs travel rounded to bfloat16) and lse within 1e-5 absolute."""

import functools
import os
import socket
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

import sparse_attn as sa  # noqa: E402
import sparse_attn.distributed as sd  # noqa: E402
from sparse_attn import reference as ref  # noqa: E402

T = sa.TILE_Q
PARTIALS_TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
WORKER_TIMEOUT_S = 120


# ---- the cases -------------------------------------------------------------------------------------

def _uneven_tile_lists(rng, B, G, Tq, Tk, causal):
    """Ascending lists: some tiles empty, some with every (visible) block, the rest random (invisible
    future blocks included under causal: the executors skip them)."""
    kind = rng.integers(0, 4, (B, G, Tq))
    chosen = rng.random((B, G, Tq, Tk)) < 0.3
    every = np.arange(Tk) <= (np.arange(Tq)[:, None] if causal else Tk)
    chosen = np.where((kind == 1)[..., None], every, chosen) & (kind != 0)[..., None]
    cnt = chosen.sum(-1).astype(np.int32)
    # The chosen ids first, ascending, then -1.
    idx = np.where(chosen, np.arange(Tk), Tk).astype(np.int32)
    idx.sort(axis=-1)
    idx[idx == Tk] = -1
    return torch.from_numpy(idx), torch.from_numpy(cnt)


def _uneven_query_lists(rng, B, Hkv, L, Tk, kq):
    """Distinct ids in random order, -1 for empty slots: the queries of the first tile fill every
    slot, every seventh query selects nothing, the rest a random number."""
    ids = np.argsort(rng.random((B, Hkv, L, Tk)), axis=-1)[..., :kq].astype(np.int32)
    n = rng.integers(0, kq + 1, (B, Hkv, L))
    n[:, :, :T] = kq
    n[:, :, ::7] = 0
    ids[np.arange(kq) >= n[..., None]] = -1
    return torch.from_numpy(ids)


# name: (op, B, L, Hq, Hkv, D, causal, dtype, selection)
CASES = {
    "dense_causal_gqa": ("dense", 1, 1000, 4, 2, 16, True, torch.float32, None),
    "dense_noncausal": ("dense", 2, 640, 2, 2, 16, False, torch.float32, None),
    "tiles_causal_gqa": ("tile_sparse", 1, 1100, 4, 2, 16, True, torch.float32, "hkv"),
    "tiles_noncausal_per_head": ("tile_sparse", 2, 900, 4, 2, 16, False, torch.float32, "hq"),
    "tiles_causal_bf16": ("tile_sparse", 1, 1024, 4, 1, 32, True, torch.bfloat16, "hkv"),
    "query_causal_gqa": ("query_sparse", 1, 1000, 4, 2, 16, True, torch.float32, 3),
    "query_noncausal": ("query_sparse", 1, 768, 2, 1, 16, False, torch.float32, 4),
    # Three tiles make two zig-zag units: on 4 ranks two ranks hold no rows.
    "tiles_three_tiles": ("tile_sparse", 1, 300, 4, 2, 16, True, torch.float32, "hkv"),
}


@functools.lru_cache(maxsize=None)
def make_case(name):
    """Global q, k, v, the selection kwargs for plan() and the operator's selection arguments, all
    from the case's seed (the workers and the test build the same tensors)."""
    op, B, L, Hq, Hkv, D, causal, dtype, sel = CASES[name]
    seed = sum(map(ord, name))
    g, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    q, k, v = (torch.randn(B, L, H, D, generator=g).to(dtype) for H in (Hq, Hkv, Hkv))
    shape = sa.ProblemShape(B, L, L, Hq, Hkv, D, causal)
    if op == "dense":
        return shape, q, k, v, {}, ()
    if op == "tile_sparse":
        idx, cnt = _uneven_tile_lists(rng, B, Hkv if sel == "hkv" else Hq, shape.Tq, shape.Tk, causal)
        return shape, q, k, v, {"tiles": (idx, cnt)}, (idx, cnt)
    idx = _uneven_query_lists(rng, B, Hkv, L, shape.Tk, sel)
    return shape, q, k, v, {"query_lists": idx}, (idx,)


@functools.lru_cache(maxsize=None)
def single_process(name):
    op = CASES[name][0]
    shape, q, k, v, _, sel = make_case(name)
    return getattr(sa, op)(q, k, v, *sel, causal=shape.causal, return_lse=True)


# ---- the workers ------------------------------------------------------------------------------------

def _worker(rank, world, port, outdir):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for name in CASES:
            op = CASES[name][0]
            shape, q, k, v, sel_kw, sel = make_case(name)
            for strategy in sd.STRATEGIES:
                plan = sd.plan(shape, world, dtype=q.dtype, strategy=strategy, **sel_kw)
                ql, kl, vl = (plan.shard(x, rank) for x in (q, k, v))
                out, lse, stats = getattr(sd, op)(ql, kl, vl, *sel, plan, return_lse=True, return_stats=True)
                again = getattr(sd, op)(ql, kl, vl, *sel, plan)
                results[name, strategy] = {
                    "out": out, "lse": lse, "stats": stats, "repeat_equal": torch.equal(again, out),
                    "gathered_out": sd.gather(out, plan), "gathered_lse": sd.gather(lse, plan, dim=2)}
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world, outdir):
    ctx = mp.start_processes(_worker, args=(world, _free_port(), str(outdir)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"{world} gloo workers did not finish within {WORKER_TIMEOUT_S} s")
    return [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def runs(request, tmp_path_factory):
    world = request.param
    return world, _spawn(world, tmp_path_factory.mktemp(f"world{world}"))


# ---- operators against one process -----------------------------------------------------------------

def _gathered(runs, name, strategy):
    """(plan, out, lse) of the workers' run of one case and strategy, reassembled in sequence order."""
    world, per_rank = runs
    shape, q, _, _, sel_kw, _ = make_case(name)
    plan = sd.plan(shape, world, dtype=q.dtype, strategy=strategy, **sel_kw)
    out = plan.unshard([r[name, strategy]["out"] for r in per_rank])
    lse = plan.unshard([r[name, strategy]["lse"] for r in per_rank], dim=2)
    return plan, out, lse


@pytest.mark.parametrize("name", list(CASES))
def test_kv_exchange_is_bitwise_the_single_process_result(runs, name):
    _, out, lse = _gathered(runs, name, "kv")
    want_out, want_lse = single_process(name)
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out, want_out), f"max diff {(out.float() - want_out.float()).abs().max()}"
    assert torch.equal(lse, want_lse)


@pytest.mark.parametrize("name", list(CASES))
def test_partial_exchange_matches_single_process_within_tolerance(runs, name):
    _, out, lse = _gathered(runs, name, "partials")
    want_out, want_lse = single_process(name)
    assert out.dtype == want_out.dtype and torch.isfinite(out.float()).all()
    err = ref.rel_err(out.float().numpy(), want_out.float().numpy())
    assert err <= PARTIALS_TOL[out.dtype], f"relerr {err:.3g}"
    # Rows that see no key (the sparse cases' empty tiles and queries): lse -inf in both; the rest
    # within 1e-5.
    assert torch.isinf(want_lse).any() == (CASES[name][0] != "dense")
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    assert (lse[fin] - want_lse[fin]).abs().max() <= 1e-5


@pytest.mark.parametrize("strategy", sd.STRATEGIES)
@pytest.mark.parametrize("name", list(CASES))
def test_runs_report_the_planned_bytes_repeat_and_gather(runs, name, strategy):
    plan, out, lse = _gathered(runs, name, strategy)
    for rank, r in enumerate(runs[1]):
        res = r[name, strategy]
        assert res["stats"]["strategy"] == strategy
        assert res["stats"]["bytes_sent"] == plan.traffic[strategy].sent[rank]
        assert res["stats"]["bytes_received"] == plan.traffic[strategy].received[rank]
        assert res["stats"]["work"] == plan.work[rank]
        assert res["repeat_equal"], "a second run differs from the first (bitwise)"
        assert torch.equal(res["gathered_out"], out) and torch.equal(res["gathered_lse"], lse)


# ---- the planner, in this process --------------------------------------------------------------------

def _direct_traffic(shape, R, owner, itemsize, tiles=None, query_lists=None):
    """Bytes of both strategies counted pair by pair from the lists (the definitions of the module
    text), as [src][dst] matrices."""
    B, L, Hq, Hkv, D, Tq = shape.B, shape.Lq, shape.Hq, shape.Hkv, shape.D, shape.Tq
    pairs = set()  # (b, kv head, query tile, block): block selected and visible
    if tiles is not None:
        idx, cnt = (x.numpy() for x in tiles)
        per = Hq // idx.shape[1]
        for b, g, t in np.ndindex(*cnt.shape):
            for j in idx[b, g, t, :cnt[b, g, t]]:
                if not shape.causal or j <= t:
                    pairs.add((b, g * per // (Hq // Hkv), t, int(j)))
    elif query_lists is not None:
        idx = query_lists.numpy()
        for b, h, i, s in np.ndindex(*idx.shape):
            j = idx[b, h, i, s]
            if j >= 0 and (not shape.causal or j <= i // T):
                pairs.add((b, h, i // T, int(j)))
    else:
        pairs = {(b, h, t, j) for b in range(B) for h in range(Hkv) for t in range(Tq) for j in range(Tq)
                 if not shape.causal or j <= t}
    kv_triples, q_units = set(), set()
    for b, h, t, j in pairs:
        if owner[t] != owner[j]:
            kv_triples.add((owner[j], owner[t], b, h, j))
            q_units.add((owner[t], owner[j], t))
    kv = np.zeros((R, R), dtype=np.int64)
    part = np.zeros((R, R), dtype=np.int64)
    for src, dst, *_ in kv_triples:
        kv[src, dst] += 2 * T * D * itemsize
    for home, other, _ in q_units:
        part[home, other] += B * T * Hq * D * itemsize
        part[other, home] += B * T * Hq * (D * itemsize + 4)
    return kv, part


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_planner_bytes_equal_a_direct_count(name, world):
    shape, q, _, _, sel_kw, _ = make_case(name)
    plan = sd.plan(shape, world, dtype=q.dtype, **sel_kw)
    owner = [None] * shape.Tq
    for r, ts in enumerate(plan.tiles):
        for t in ts:
            owner[t] = r
    assert None not in owner and sorted(t for ts in plan.tiles for t in ts) == list(range(shape.Tq))
    kv, part = _direct_traffic(shape, world, owner, q.element_size(), **sel_kw)
    assert np.array_equal(np.array(plan.traffic["kv"].matrix), kv)
    assert np.array_equal(np.array(plan.traffic["partials"].matrix), part)
    t = plan.traffic[plan.strategy]
    assert t.total == sum(t.sent) == sum(t.received)
    other = "partials" if plan.strategy == "kv" else "kv"
    assert t.total <= plan.traffic[other].total


def test_planner_picks_partials_when_queries_are_cheaper_to_move():
    # Non-causal, Hq = Hkv = 1: every tile selects its own block, and tile 0 also every other block.
    # Moving tile 0's q and its partial back (one tile each way) costs less than moving the other
    # rank's eight blocks, whichever rank holds tile 0.
    shape = sa.ProblemShape(1, 16 * T, 16 * T, 1, 1, 64, False)
    idx = torch.arange(16, dtype=torch.int32).repeat(1, 1, 16, 1)
    cnt = torch.ones((1, 1, 16), dtype=torch.int32)
    idx[0, 0, 1:, 0] = torch.arange(1, 16, dtype=torch.int32)
    cnt[0, 0, 0] = 16
    plan = sd.plan(shape, 2, dtype=torch.float32, tiles=(idx, cnt), chunk_tiles=4)
    assert plan.traffic["kv"].total == 8 * 2 * T * 64 * 4
    assert plan.traffic["partials"].total == T * 64 * 4 + T * (64 * 4 + 4)
    assert plan.strategy == "partials"
    # Dense causal with GQA: every rank needs nearly every block, and K/V are the smaller side.
    dense = sd.plan(sa.ProblemShape(1, 16 * T, 16 * T, 8, 2, 64, True), 4, dtype=torch.bfloat16)
    assert dense.strategy == "kv" and dense.traffic["kv"].total < dense.traffic["partials"].total


def test_partition_keeps_equal_pair_counts_and_balances_uneven_work():
    # Work on the first quarter of the tiles only: the plain zig-zag puts it on rank 0.
    Tq = 32
    shape = sa.ProblemShape(1, Tq * T, Tq * T, 2, 1, 16, False)
    idx = torch.full((1, 1, Tq, Tq), -1, dtype=torch.int32)
    cnt = torch.zeros((1, 1, Tq), dtype=torch.int32)
    for t in range(Tq // 4):
        cnt[0, 0, t] = Tq
        idx[0, 0, t] = torch.arange(Tq)
    plan = sd.plan(shape, 4, dtype=torch.float32, tiles=(idx, cnt), chunk_tiles=1)
    assert plan.layout == "balanced"
    assert [len(ts) for ts in plan.tiles] == [8, 8, 8, 8]
    assert plan.balance == pytest.approx(max(plan.work) / (sum(plan.work) / 4))
    assert plan.balance == 1.0
    # Each rank holds whole zig-zag pairs (t with 31 - t).
    for ts in plan.tiles:
        assert sorted(Tq - 1 - t for t in ts) == list(ts)
    # Dense causal: the plain zig-zag is already balanced and kept (contiguous runs).
    dense = sd.plan(sa.ProblemShape(1, Tq * T, Tq * T, 2, 1, 16, True), 4, dtype=torch.float32, chunk_tiles=4)
    assert dense.layout == "zigzag" and dense.balance == 1.0
    assert dense.tiles[0] == tuple(range(4)) + tuple(range(28, 32))


def test_merge_is_the_log_sum_exp_combine_in_rank_order():
    # Rank 1 of 3 holds tiles 1 and 2 of 4 (chunk 1: pairs (0, 3) and (1, 2); LPT off on equal work).
    shape = sa.ProblemShape(1, 3 * T + 5, 3 * T + 5, 2, 1, 8, False)
    plan = sd.plan(shape, 2, dtype=torch.float32, chunk_tiles=1)
    assert plan.tiles[1] == (1, 2)
    g = torch.Generator().manual_seed(3)
    n = 2 * T
    own = torch.randn(1, n, 2, 8, generator=g), torch.randn(1, 2, n, generator=g) * 3
    other_o, other_l = torch.randn(2, 1, T, 2, 8, generator=g), torch.randn(2, 1, 2, T, generator=g) * 3
    own[1][0, 0, 5] = float("-inf")           # one side empty: the other side's partial as it is
    other_l[0, 0, 1, 7] = float("-inf")
    own[1][0, 1, 7] = float("-inf")           # both empty: out 0, lse -inf
    other_l[1, 0, 0, 9] = float("nan")        # a NaN partial: NaN row (tile 2, row 9, head 0)
    received = [(torch.tensor([0, 1]), other_o, other_l), None]
    out, lse = sd._merge(plan, 1, own, received)
    # float64 reference: per row, logsumexp over the two sides.
    lo = other_l.permute(1, 2, 0, 3).reshape(1, 2, n).double()
    oo = other_o.permute(1, 0, 2, 3, 4).reshape(1, n, 2, 8).double()
    want_lse = torch.logaddexp(own[1].double(), lo)
    w_own = torch.exp(own[1].double() - want_lse).nan_to_num(0.0).permute(0, 2, 1)[..., None]
    w_oth = torch.exp(lo - want_lse).nan_to_num(0.0).permute(0, 2, 1)[..., None]
    want = w_own * own[0].double() + w_oth * oo
    assert torch.isnan(out[0, T + 9, 0]).all() and torch.isnan(lse[0, 0, T + 9])
    assert torch.equal(out[0, 7, 1], torch.zeros(8)) and lse[0, 1, 7] == float("-inf")
    assert torch.equal(out[0, 5, 0], other_o[0, 0, 5, 0]) and lse[0, 0, 5] == other_l[0, 0, 0, 5]
    ok = torch.ones_like(lse, dtype=torch.bool)
    ok[0, 0, T + 9] = False
    ok[0, 1, 7] = False
    assert torch.isfinite(lse[ok]).all()
    assert (lse[ok].double() - want_lse[ok]).abs().max() < 1e-5
    rows = ok.permute(0, 2, 1)
    assert (out[rows].double() - want[rows]).abs().max() < 1e-5


def test_plan_and_operator_errors():
    shape = sa.ProblemShape(1, 4 * T, 4 * T, 2, 1, 16, True)
    with pytest.raises(sa.Error, match="Lq == Lk"):
        sd.plan(sa.ProblemShape(1, T, 2 * T, 2, 1, 16, True), 2, dtype=torch.float32)
    with pytest.raises(sa.Error, match="strategy"):
        sd.plan(shape, 2, dtype=torch.float32, strategy="ring")
    with pytest.raises(sa.Error, match="world_size"):
        sd.plan(shape, 0, dtype=torch.float32)
    bad = torch.full((1, 1, 4, 2), 7, dtype=torch.int32), torch.ones((1, 1, 4), dtype=torch.int32)
    with pytest.raises(sa.Error, match="tiles.idx"):
        sd.plan(shape, 2, dtype=torch.float32, tiles=bad)
    plan = sd.plan(shape, 2, dtype=torch.float32)
    q = torch.randn(1, 2 * T, 2, 16)
    with pytest.raises(sa.Error, match="not initialised"):
        sd.dense(q, q[:, :, :1], q[:, :, :1], plan)


@pytest.fixture
def group_of_one(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_and_a_plan_of_another_selection(group_of_one):
    shape, q, k, v, _, (idx, cnt) = make_case("tiles_causal_gqa")
    idx, cnt = idx.clone(), cnt.clone()  # changed in place below
    sel_kw = {"tiles": (idx, cnt)}
    want_out, want_lse = single_process("tiles_causal_gqa")
    for strategy in sd.STRATEGIES:
        plan = sd.plan(shape, 1, dtype=q.dtype, strategy=strategy, **sel_kw)
        assert plan.traffic[strategy].total == 0 and plan.balance == 1.0
        out, lse = sd.tile_sparse(q, k, v, idx, cnt, plan, return_lse=True)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    # Equal contents in another tensor pass; changed contents, another kind or another shard do not.
    assert torch.equal(sd.tile_sparse(q, k, v, idx.clone(), cnt.clone(), plan), want_out)
    other = cnt.clone()
    other[0, 0, 0] = 0
    with pytest.raises(sa.Error, match="another selection"):
        sd.tile_sparse(q, k, v, idx, other, plan)
    with pytest.raises(sa.Error, match="another selection"):
        sd.dense(q, k, v, plan)
    with pytest.raises(sa.Error, match="argument 'q'"):
        sd.tile_sparse(q[:, :T], k, v, idx, cnt, plan)
    two = sd.plan(shape, 2, dtype=q.dtype, **sel_kw)
    with pytest.raises(sa.Error, match="made for 2 ranks"):
        sd.tile_sparse(q, k, v, idx, cnt, two)
    with pytest.raises(sa.Error, match="2-byte elements"):
        sd.tile_sparse(q, k, v, idx, cnt, sd.plan(shape, 1, dtype=torch.bfloat16, **sel_kw))
    cnt[0, 0, 0] = 0  # the plan's own tensor, changed after it was made
    with pytest.raises(sa.Error, match="another selection"):
        sd.tile_sparse(q, k, v, idx, cnt, plan)
    # Inference-mode lists keep no version counter: checked by contents.
    with torch.inference_mode():
        idx_i, cnt_i = idx.clone(), cnt.clone()
        plan = sd.plan(shape, 1, dtype=q.dtype, tiles=(idx_i, cnt_i))
        out = sd.tile_sparse(q, k, v, idx_i, cnt_i, plan)
        cnt_i[0, 0, 1] = 0
        with pytest.raises(sa.Error, match="another selection"):
            sd.tile_sparse(q, k, v, idx_i, cnt_i, plan)
    assert torch.equal(out, sa.tile_sparse(q, k, v, idx, cnt, causal=True))


# ---- the multi-GPU benchmark, in its CPU mode --------------------------------------------------------

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "gpu", "bench_distributed.py")


def test_bench_distributed_runs_on_two_gloo_processes(tmp_path):
    import json
    import subprocess
    import sys
    out = tmp_path / "cp.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        BENCH, "--device", "cpu", "--len", "1024", "--heads", "4,2", "--head-dim", "32", "--quick",
                        "--json", str(out)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["workload"], row["impl"]) for row in rows] == [
        ("dense", "sparse_attn"), ("dense", "ring_sdpa_cpu"), ("sparse", "sparse_attn")]
    for row in rows:
        assert row["verify"]["ok"] and row["world_size"] == 2
        assert row["ms"] > 0 and row["scaling_efficiency"] > 0 and row["balance"] >= 1.0
        assert sum(row["bytes_sent"]) == sum(row["bytes_received"]) > 0
    lib = rows[0]
    assert lib["bytes_sent"] == lib["plan"][f"{lib['plan']['strategy']}_bytes_sent"]
    # The ring moves R - 1 = 1 K/V shard (2 x 512 rows x 2 heads x 32 x bf16) each way.
    assert rows[1]["bytes_sent"] == [2 * 512 * 2 * 32 * 2] * 2
