"""Selectors against brute-force float64 scoring: the lists must be a top-k of the reference scores
(up to float32 rounding), ascending, -1 padded, with forced blocks present."""

import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import reference as ref

from _util import check_top_k, ml_dtypes, randn


def _bf16_exact(rng, shape, scale=1.0):
    """float32 values that bf16 holds exactly, so bf16 index precision rounds nothing."""
    x = randn(rng, shape, "float32", scale)
    if ml_dtypes is not None:
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _fp8_round(x):
    """Per-tensor scaled e4m3 rounding (scale = amax / 448), independently of the library."""
    if ml_dtypes is None:
        pytest.skip("ml_dtypes is not installed")
    scale = np.abs(x).max() / 448.0
    return (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale


def _assert_lists(idx, cnt=None):
    """Ascending ids, -1 after the last one (or after cnt)."""
    for pos in np.ndindex(idx.shape[:-1]):
        row = idx[pos]
        n = int(cnt[pos]) if cnt is not None else int((row >= 0).sum())
        assert np.all(row[n:] == -1), (pos, row)
        assert np.all(np.diff(row[:n]) > 0), (pos, row)


@pytest.mark.parametrize("r", [1, 4])
@pytest.mark.parametrize("shape", [(2, 300, 1000, 4, 1), (1, 17, 520, 2, 2), (1, 1, 700, 16, 1)],
                         ids=["B2_gqa4", "Lq17_mha", "Lq1_gqa16"])
def test_pooled_select_is_top_k_of_pooled_scores(rng, shape, r):
    B, Lq, Lk, Hq, Hkv = shape
    q, k = randn(rng, (B, Lq, Hq, 32)), randn(rng, (B, Lk, Hkv, 32))
    idx, cnt = sa.pooled_select(q, k, top_k=3, representatives=r, force_local=False, kmax=5)
    assert idx.shape == (B, Hkv, (Lq + 127) // 128, 5) and cnt.dtype == np.int32
    _assert_lists(idx, cnt)
    scores = ref.pooled_scores(q, k, representatives=r)
    for b, g, t in np.ndindex(cnt.shape):
        check_top_k(idx[b, g, t, : cnt[b, g, t]], scores[b, g, t], 3, 1e-4, f"[{b}, {g}, {t}]")


def test_pooled_select_causal_candidates_and_forced_blocks(rng):
    B, Lq, Lk, Hq, Hkv = 2, 300, 700, 4, 2
    q, k = randn(rng, (B, Lq, Hq, 32)), randn(rng, (B, Lk, Hkv, 32))
    idx, cnt = sa.pooled_select(q, k, top_k=4, causal=True, force_local=True, force_block0=True)
    _assert_lists(idx, cnt)
    cand = ref.pooled_candidates(Lq, Lk, True)
    offset = Lk - Lq
    for b, g, t in np.ndindex(cnt.shape):
        ids = idx[b, g, t, : cnt[b, g, t]]
        assert cnt[b, g, t] == min(4, int(cand[t].sum()))
        assert np.all(cand[t, ids]), "a block no query of the tile can see"
        last_q = min(Lq, (t + 1) * 128) - 1
        assert 0 in ids and (last_q + offset) // 128 in ids, f"forced blocks missing at tile {t}: {ids}"


def test_pooled_select_different_lists_per_batch(rng):
    q, k = randn(rng, (2, 128, 1, 16)), randn(rng, (2, 2048, 1, 16))
    k[1] = np.roll(k[0], 1024, axis=0)  # batch 1 holds batch 0's keys moved by 8 blocks
    q[1] = q[0]
    idx, cnt = sa.pooled_select(q, k, top_k=2, force_local=False)
    assert set(((idx[0, 0, 0] + 8) % 16).tolist()) == set(idx[1, 0, 0].tolist())


@pytest.mark.parametrize("kv_heads", ["shared", "per_group"])
@pytest.mark.parametrize("causal", [True, False])
def test_token_max_query_lists(rng, causal, kv_heads):
    B, Lq, Lk, Hkv, Di = 2, 17, 600, 2, 32
    qidx = _bf16_exact(rng, (B, Lq, Hkv, Di))
    kidx = _bf16_exact(rng, (B, Lk, 1 if kv_heads == "shared" else Hkv, Di))
    idx = sa.token_max_select(qidx, kidx, top_k=3, causal=causal, reserve_local=False, kmax=4)
    assert idx.shape == (B, Hkv, Lq, 4)
    _assert_lists(idx)
    scores = ref.token_max_scores(qidx, kidx, causal=causal)
    for b, g, i in np.ndindex(B, Hkv, Lq):
        check_top_k(idx[b, g, i], scores[b, g, i], 3, 1e-4, f"[{b}, {g}, {i}]")


def test_token_max_reserves_the_local_block(rng):
    B, Lq, Lk, Hkv, Di = 1, 40, 900, 1, 16
    qidx, kidx = _bf16_exact(rng, (B, Lq, Hkv, Di)), _bf16_exact(rng, (B, Lk, 1, Di))
    idx = sa.token_max_select(qidx, kidx, top_k=2, causal=True, reserve_local=True)
    scores = ref.token_max_scores(qidx, kidx, causal=True)
    for i in range(Lq):
        local = (i + Lk - Lq) // 128
        assert local in idx[0, 0, i]
        others = idx[0, 0, i][(idx[0, 0, i] >= 0) & (idx[0, 0, i] != local)]
        row = scores[0, 0, i].copy()
        row[local] = -np.inf
        check_top_k(others, row, 1, 1e-4, f"query {i}")


@pytest.mark.parametrize("fmt", ["query", "tile"])
def test_token_max_force_block0_keeps_the_sink(rng, fmt):
    B, Lq, Lk, Hkv, Di = 1, 200, 700, 1, 16
    qidx, kidx = _bf16_exact(rng, (B, Lq, Hkv, Di)), _bf16_exact(rng, (B, Lk, 1, Di))
    plain = sa.token_max_select(qidx, kidx, top_k=3, causal=True, reserve_local=False, format=fmt)
    sink = sa.token_max_select(qidx, kidx, top_k=3, causal=True, reserve_local=False, force_block0=True,
                               format=fmt)
    idx = sink[0] if fmt == "tile" else sink
    rows = idx.reshape(-1, idx.shape[-1])
    assert (rows[:, 0] == 0).all()  # ascending lists: block 0 first in every list (all see a key)
    scores = ref.token_max_scores(qidx, kidx, causal=True, per_tile=fmt == "tile").reshape(len(rows), -1).copy()
    scores[:, 0] = -np.inf
    for r, row in enumerate(rows):
        check_top_k(row[1:][row[1:] >= 0], scores[r], 2, 1e-4, f"list {r}")
    # top_k = 1 with the local block reserved too: the lower forced id, block 0, wins.
    one = sa.token_max_select(qidx, kidx, top_k=1, causal=True, force_block0=True, format=fmt)
    one = one[0] if fmt == "tile" else one
    assert (one == 0).all()
    assert not np.array_equal(plain[0] if fmt == "tile" else plain, idx)


def test_token_max_tile_lists(rng):
    B, Lq, Lk, Hkv, Di = 1, 200, 700, 2, 16
    qidx, kidx = _bf16_exact(rng, (B, Lq, Hkv, Di)), _bf16_exact(rng, (B, Lk, Hkv, Di))
    idx, cnt = sa.token_max_select(qidx, kidx, top_k=3, causal=True, reserve_local=False, format="tile")
    assert idx.shape == (B, Hkv, 2, 3)
    _assert_lists(idx, cnt)
    scores = ref.token_max_scores(qidx, kidx, causal=True, per_tile=True)
    for b, g, t in np.ndindex(cnt.shape):
        check_top_k(idx[b, g, t, : cnt[b, g, t]], scores[b, g, t], 3, 1e-4, f"[{b}, {g}, {t}]")


def test_token_max_fp8_scores_rounded_inputs(rng):
    B, Lq, Lk, Hkv, Di = 1, 9, 1100, 1, 32
    qidx, kidx = randn(rng, (B, Lq, Hkv, Di)), randn(rng, (B, Lk, 1, Di))
    idx = sa.token_max_select(qidx, kidx, top_k=3, precision="fp8_e4m3", causal=False, reserve_local=False)
    scores = ref.token_max_scores(_fp8_round(qidx), _fp8_round(kidx), causal=False)
    for i in range(Lq):
        check_top_k(idx[0, 0, i], scores[0, 0, i], 3, 1e-4, f"query {i}")


def test_token_max_fp4_is_close_to_exact(rng):
    B, Lq, Lk, Hkv, Di = 1, 9, 1100, 1, 32
    qidx, kidx = randn(rng, (B, Lq, Hkv, Di)), randn(rng, (B, Lk, 1, Di))
    idx = sa.token_max_select(qidx, kidx, top_k=3, precision="fp4_e2m1", causal=False, reserve_local=False)
    _assert_lists(idx)
    scores = ref.token_max_scores(qidx, kidx, causal=False)
    # e2m1 keeps one mantissa bit: allow the rounding of a dot product of 32 terms.
    tol = 0.35 * np.sqrt(Di) * 2.0
    for i in range(Lq):
        check_top_k(idx[0, 0, i], scores[0, 0, i], 3, tol, f"query {i}")


@pytest.mark.parametrize("causal", [True, False])
def test_lightning_token_lists(rng, causal):
    B, Lq, Lk, HI, Di = 2, 17, 300, 4, 32
    qI, kI = _bf16_exact(rng, (B, Lq, HI, Di)), _bf16_exact(rng, (B, Lk, Di))
    w = np.abs(randn(rng, (B, Lq, HI))) + 0.1
    idx = sa.lightning_select(qI, w, kI, top_k=20, causal=causal, precision="bf16", groups=2, kmax=24)
    assert idx.shape == (B, 2, Lq, 24)
    _assert_lists(idx)
    np.testing.assert_array_equal(idx[:, 0], idx[:, 1])  # the same lists for every group
    scores = ref.lightning_scores(qI, w, kI, causal=causal)
    for b, i in np.ndindex(B, Lq):
        check_top_k(idx[b, 0, i], scores[b, i], 20, 1e-3, f"[{b}, {i}]")


def test_lightning_query_lists_pool_to_blocks(rng):
    B, Lq, Lk, HI, Di = 1, 17, 700, 2, 16
    qI, kI = _bf16_exact(rng, (B, Lq, HI, Di)), _bf16_exact(rng, (B, Lk, Di))
    w = np.abs(randn(rng, (B, Lq, HI))) + 0.1
    idx = sa.lightning_select(qI, w, kI, top_k=2, causal=True, precision="bf16", format="query")
    _assert_lists(idx)
    tok = ref.lightning_scores(qI, w, kI, causal=True)
    blocks = np.stack([tok[..., j * 128:(j + 1) * 128].max(axis=-1) for j in range(6)], axis=-1)
    for i in range(Lq):
        check_top_k(idx[0, 0, i], blocks[0, i], 2, 1e-3, f"query {i}")


@pytest.mark.parametrize("fmt", ["token", "query"])
def test_lightning_sink_keys_are_always_selected(rng, fmt):
    B, Lq, Lk, HI, Di, sink = 1, 40, 400, 2, 16, 3
    k = 6 if fmt == "token" else 1  # a query sees at most 4 blocks
    qI, kI = _bf16_exact(rng, (B, Lq, HI, Di)), _bf16_exact(rng, (B, Lk, Di))
    w = np.abs(randn(rng, (B, Lq, HI))) + 0.1
    idx = sa.lightning_select(qI, w, kI, top_k=k, causal=True, precision="bf16", format=fmt, sink_keys=sink)
    _assert_lists(idx)
    scores = ref.lightning_scores(qI, w, kI, causal=True)
    scores[..., :sink] = np.where(np.isfinite(scores[..., :sink]), 1e300, -np.inf)  # visible sinks rank first
    if fmt == "query":
        scores = np.stack([scores[..., j * 128:(j + 1) * 128].max(axis=-1) for j in range(4)], axis=-1)
    for i in range(Lq):
        np.testing.assert_array_equal(idx[0, 0, i][idx[0, 0, i] >= 0], ref.top_k(scores[0, i], k), f"query {i}")
    plain = sa.lightning_select(qI, w, kI, top_k=k, causal=True, precision="bf16", format=fmt)
    assert not np.array_equal(plain, idx)
    with pytest.raises(sa.Error, match=r"lightning_select: argument 'sink_keys': must be >= 0, got -1"):
        sa.lightning_select(qI, w, kI, top_k=k, sink_keys=-1)


def test_lightning_fp8_default_precision(rng):
    B, Lq, Lk, HI, Di = 1, 5, 400, 2, 32
    qI, kI = randn(rng, (B, Lq, HI, Di)), randn(rng, (B, Lk, Di))
    w = np.abs(randn(rng, (B, Lq, HI))) + 0.1
    idx = sa.lightning_select(qI, w, kI, top_k=8, causal=False)
    _assert_lists(idx)
    exact = ref.lightning_scores(qI, w, kI, causal=False)
    for i in range(Lq):
        # e4m3 keeps 3 mantissa bits: scores move by a few percent of their scale.
        check_top_k(idx[0, 0, i], exact[0, i], 8, 0.1 * np.abs(exact[0, i]).max(), f"query {i}")


def test_workspace_bytes_and_the_workspace_keyword():
    q = np.random.default_rng(3).standard_normal((1, 256, 2, 64)).astype(np.float32)
    k = np.random.default_rng(4).standard_normal((1, 512, 1, 64)).astype(np.float32)
    kI = k[:, :, 0, :].copy()
    w = np.full((1, 256, 2), 0.5, dtype=np.float32)
    # Nothing on the CPU: the keyword is accepted and the lists are those of a call without it.
    assert sa.pooled_workspace_bytes(q, k) == 0
    assert sa.token_max_workspace_bytes(q, k, format="tile") == 0
    assert sa.lightning_workspace_bytes(q, kI) == 0
    ws = np.zeros(16, dtype=np.uint8)
    for a, b in zip(sa.pooled_select(q, k, top_k=2, workspace=ws), sa.pooled_select(q, k, top_k=2)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(sa.token_max_select(q, k, top_k=2, workspace=ws), sa.token_max_select(q, k, top_k=2))
    np.testing.assert_array_equal(sa.lightning_select(q, w, kI, top_k=8, workspace=ws),
                                  sa.lightning_select(q, w, kI, top_k=8))
    with pytest.raises(sa.Error, match="token_max_workspace_bytes: argument 'format'"):
        sa.token_max_workspace_bytes(q, k, format="blocks")
