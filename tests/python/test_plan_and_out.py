"""plan_schedule against selection statistics counted here, and out= of the selectors and of
query_lists_to_tile_lists against the allocating calls (CPU)."""
import math

import numpy as np
import pytest

import sparse_attn as sa

from _util import qkv, random_query_lists


@pytest.mark.parametrize("causal", [False, True])
def test_plan_schedule_counts_the_selection(rng, causal):
    p = sa.ProblemShape(2, 300, 700, 8, 2, 64, causal)  # partial last tile and block, GQA 4
    lists = random_query_lists(rng, 2, 2, p.Lq, p.Tk, kq=3)
    plan = sa.plan_schedule(lists, p, partials="bf16")
    st = plan["stats"]
    visible_block = lambda i, j: not causal or j * 128 <= p.key_end(i) - 1
    blocks = [[[set(int(j) for j in lists[b, g, i] if j >= 0 and visible_block(i, j)) for i in range(p.Lq)]
               for g in range(2)] for b in range(2)]
    unions = [set().union(*blocks[b][g][t * 128:(t + 1) * 128])
              for b in range(2) for g in range(2) for t in range(p.Tq)]
    pairs = sum(min(p.Lk, (j + 1) * 128) - j * 128 if not causal else max(0, min(p.key_end(i), (j + 1) * 128) - j * 128)
                for b in range(2) for g in range(2) for i in range(p.Lq) for j in blocks[b][g][i])
    assert (st["tiles"], st["queries"], st["list_slots"]) == (2 * 2 * p.Tq, 2 * 2 * p.Lq, 2 * 2 * p.Lq * 3)
    assert st["query_blocks"] == sum(len(s) for bb in blocks for gg in bb for s in gg)
    assert st["tile_union"] == sum(len(u) for u in unions) and st["max_tile_union"] == max(len(u) for u in unions)
    assert st["selected_pairs"] == pairs
    assert st["window_pieces"][1] == st["query_blocks"] and len(st["window_pieces"]) == 9
    est = {s: plan[s + "_ms"] for s in ("q_centric", "kv_centric", "group_centric")}
    assert all(v > 0 for v in est.values())
    assert plan["schedule"] == min(est, key=est.get) and plan["schedule"] in plan["reason"]
    assert plan["merge_window"] >= 1
    assert sa.plan_schedule(lists, p, partials="bf16", merge_window=1)["merge_window"] == 1


def test_plan_schedule_refuses_bad_options(rng):
    p = sa.ProblemShape(1, 128, 512, 2, 1, 64)
    lists = random_query_lists(rng, 1, 1, p.Lq, p.Tk, kq=2)
    with pytest.raises(ValueError, match="plan_schedule: argument 'partials'.*'fp8'"):
        sa.plan_schedule(lists, p, partials="fp8")
    with pytest.raises(ValueError, match="merge_window"):
        sa.plan_schedule(lists, p, merge_window=9)
    lists[0, 0, 5, 0] = p.Tk  # validated before it is counted
    with pytest.raises(ValueError, match=r"plan_schedule|lists"):
        sa.plan_schedule(lists, p)
    assert math.isfinite(sa.plan_schedule(random_query_lists(rng, 1, 1, p.Lq, p.Tk, kq=2), p)["kv_centric_ms"])


def test_selectors_and_conversion_write_into_out(rng):
    q, k, _ = qkv(rng, 1, 300, 700, 4, 2, 32)
    idx = np.full((1, 2, 3, 4), 99, np.int32)
    cnt = np.full((1, 2, 3), 99, np.int32)
    got = sa.pooled_select(q, k, top_k=2, out=(idx, cnt))
    want = sa.pooled_select(q, k, top_k=2, kmax=4)
    assert got[0] is idx and got[1] is cnt
    np.testing.assert_array_equal(idx, want[0])  # slots past the count are -1, written by the selector
    np.testing.assert_array_equal(cnt, want[1])

    qidx, kidx = q[:, :, ::2], k
    for fmt, out in (("tile", (np.full((1, 2, 3, 3), 99, np.int32), np.full((1, 2, 3), 99, np.int32))),
                     ("query", np.full((1, 2, 300, 3), 99, np.int32))):
        got = sa.token_max_select(qidx, kidx, top_k=3, causal=False, format=fmt, out=out)
        want = sa.token_max_select(qidx, kidx, top_k=3, causal=False, format=fmt)
        for g, w in zip(got if fmt == "tile" else (got,), want if fmt == "tile" else (want,)):
            np.testing.assert_array_equal(g, w)
        assert got is out or got[0] is out[0]

    p = sa.ProblemShape(1, 300, 700, 4, 2, 32)
    lists = random_query_lists(rng, 1, 2, p.Lq, p.Tk, kq=2)
    out = (np.full((1, 2, p.Tq, p.Tk), 99, np.int32), np.full((1, 2, p.Tq), 99, np.int32))
    got = sa.query_lists_to_tile_lists(lists, p, out=out)
    want = sa.query_lists_to_tile_lists(lists, p)
    assert got[0] is out[0]
    np.testing.assert_array_equal(out[0], want[0])
    np.testing.assert_array_equal(out[1], want[1])
    with pytest.raises(ValueError, match="query_lists_to_tile_lists: argument 'out': expected a pair"):
        sa.query_lists_to_tile_lists(lists, p, out=out[0])


# ---- plan / run with a caller-owned workspace ---------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_plan_and_run_match_query_sparse(rng, causal):
    q, k, v = qkv(rng, 1, 300, 700, 8, 2, 32)
    lists = random_query_lists(rng, 1, 2, 300, 6, kq=3)
    plan = sa.plan(q, k, v, lists, causal=causal, softmax_scale=0.2)
    assert plan.shape.Lq == 300 and plan.shape.Lk == 700 and plan.shape.causal == causal
    expect, expect_lse = sa.query_sparse(q, k, v, lists, causal=causal, softmax_scale=0.2, return_lse=True)
    out = np.full_like(q, np.nan)
    lse = np.full((1, 8, 300), np.nan, dtype=np.float32)
    for _ in range(2):  # a plan runs any number of times, here with new values of the same shape
        got, got_lse = sa.run(plan, q, k, v, out=out, lse=lse)
        assert got is out and got_lse is lse
        np.testing.assert_array_equal(out, expect)
        np.testing.assert_array_equal(lse, expect_lse)
        q, k, v = qkv(rng, 1, 300, 700, 8, 2, 32)
        expect, expect_lse = sa.query_sparse(q, k, v, lists, causal=causal, softmax_scale=0.2, return_lse=True)


def test_run_refuses_another_shape_and_plan_checks_the_lists(rng):
    q, k, v = qkv(rng, 1, 300, 700, 8, 2, 32)
    lists = random_query_lists(rng, 1, 2, 300, 6, kq=3)
    plan = sa.plan(q, k, v, lists, causal=True)
    q2, k2, v2 = qkv(rng, 1, 300, 600, 8, 2, 32)
    with pytest.raises(sa.Error, match="query_sparse_run: argument 'k'"):
        sa.run(plan, q2, k2, v2)
    with pytest.raises(TypeError, match="run: argument 'plan'"):
        sa.run("plan", q, k, v)
    bad = lists.copy()
    bad[0, 0, 0, 0] = 99
    with pytest.raises(sa.Error, match="query_sparse_plan"):
        sa.plan(q, k, v, bad, causal=True)
    assert sa.workspace_bytes(sa.problem_shape(q, k, causal=True), 3) >= 0
