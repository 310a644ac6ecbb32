"""tile_sparse, bits_sparse, query_sparse, token_sparse and sparse_attention against dense float64
attention with the selection expanded into an explicit mask."""

import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import reference as ref

from _util import (assert_close, assert_lse, poisoned, qkv, random_query_lists, random_tile_lists,
                   random_token_lists, strided)

# (B, Lq, Lk, Hq, Hkv, D, causal)
SHAPES = [
    (2, 17, 300, 4, 1, 32, False),     # GQA 4, B > 1 with different lists, Lk % 128 != 0
    (1, 1, 300, 4, 4, 32, True),       # one query, Hq = Hkv
    (1, 200, 260, 16, 1, 32, True),    # Hq = 16 x Hkv, causal Lq < Lk, partial tiles and blocks
]
IDS = ["B2_Lq17_Lk300_gqa4", "Lq1_Lk300_mha_causal", "Lq200_Lk260_gqa16_causal"]


def _tk(Lk):
    return (Lk + 127) // 128


def _tq(Lq):
    return (Lq + 127) // 128


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("per_head", [False, True], ids=["G=Hkv", "G=Hq"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_tile_sparse(rng, shape, per_head, dtype):
    B, Lq, Lk, Hq, Hkv, D, causal = shape
    q, k, v = qkv(rng, B, Lq, Lk, Hq, Hkv, D, dtype)
    G = Hq if per_head else Hkv
    idx, cnt = random_tile_lists(rng, B, G, _tq(Lq), _tk(Lk), kmax=3)
    out = poisoned(q.shape, dtype)
    res, lse = sa.tile_sparse(q, k, v, idx, cnt, causal=causal, return_lse=True, out=out)
    assert res is out
    mask = ref.mask_from_tile_lists(idx, cnt, Lq, Lk, Hq)
    ref_out, ref_lse = ref.attention(q, k, v, mask, causal=causal)
    assert_close(out, ref_out, dtype)
    assert_lse(lse, ref_lse)
    # The tile with zero selected blocks: out = 0, lse = -inf for all its queries.
    rows = slice((_tq(Lq) - 1) * 128, Lq)
    heads = slice(0, Hq // G)
    assert np.all(out[0, rows, heads].astype(np.float32) == 0)
    assert np.all(lse[0, heads, rows] == -np.inf)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_bits_sparse_agrees_with_tile_sparse_and_reference(rng, shape):
    B, Lq, Lk, Hq, Hkv, D, causal = shape
    q, k, v = qkv(rng, B, Lq, Lk, Hq, Hkv, D)
    idx, cnt = random_tile_lists(rng, B, Hkv, _tq(Lq), _tk(Lk), kmax=3)
    bits = ref.tile_lists_to_block_bits(idx, cnt, Lk)
    out, lse = sa.bits_sparse(q, k, v, bits, causal=causal, return_lse=True)
    ref_out, ref_lse = ref.attention(q, k, v, ref.mask_from_block_bits(bits, Lq, Lk, Hq), causal=causal)
    assert_close(out, ref_out, "float32")
    assert_lse(lse, ref_lse)
    out_tiles = sa.tile_sparse(q, k, v, idx, cnt, causal=causal)
    assert ref.rel_err(out_tiles, out) <= 1e-6


@pytest.mark.parametrize("partials", ["f32", "bf16"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_query_sparse(rng, shape, dtype, partials):
    B, Lq, Lk, Hq, Hkv, D, causal = shape
    q, k, v = qkv(rng, B, Lq, Lk, Hq, Hkv, D, dtype)
    idx = random_query_lists(rng, B, Hkv, Lq, _tk(Lk), kq=3)
    out, lse = sa.query_sparse(q, k, v, idx, partials=partials, causal=causal, return_lse=True,
                               out=poisoned(q.shape, dtype))
    ref_out, ref_lse = ref.attention(q, k, v, ref.mask_from_query_lists(idx, Lk, Hq), causal=causal)
    # bf16 partials round each partial output to 8 bits before the combine.
    tol_dtype = "bfloat16" if partials == "bf16" else dtype
    assert_close(out, ref_out, tol_dtype)
    assert_lse(lse, ref_lse)
    assert np.all(out[0, 0, : Hq // Hkv].astype(np.float32) == 0)  # the empty list


def test_query_sparse_merge_window_is_the_same_attention_on_the_cpu(rng):
    # The merge window changes how the GPU's KV-centric schedule groups its work, never the result: the
    # CPU reference gives the same bits for every window it accepts.
    q, k, v = qkv(rng, 1, 96, 1024, 4, 2, 32, "float32")
    idx = random_query_lists(rng, 1, 2, 96, _tk(1024), kq=6)
    base = sa.query_sparse(q, k, v, idx, merge_window=1)
    for w in (0, 2, 5, 8):
        assert np.array_equal(sa.query_sparse(q, k, v, idx, merge_window=w), base)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_token_sparse(rng, shape, dtype):
    B, Lq, Lk, Hq, Hkv, D, causal = shape
    q, k, v = qkv(rng, B, Lq, Lk, Hq, Hkv, D, dtype)
    idx = random_token_lists(rng, B, Hkv, Lq, Lk, kt=40)
    out, lse = sa.token_sparse(q, k, v, idx, causal=causal, return_lse=True, out=poisoned(q.shape, dtype))
    ref_out, ref_lse = ref.attention(q, k, v, ref.mask_from_token_lists(idx, Lk, Hq), causal=causal)
    assert_close(out, ref_out, dtype)
    assert_lse(lse, ref_lse)


def test_strided_inputs_and_lists(rng):
    B, Lq, Lk, Hq, Hkv, D = 2, 17, 300, 4, 2, 32
    q, k, v = qkv(rng, B, Lq, Lk, Hq, Hkv, D)
    idx, cnt = random_tile_lists(rng, B, Hkv, 1, 3, kmax=3)
    wide = np.full((B, Hkv, 1, 7), -1, dtype=np.int32)
    wide[..., ::2][..., :3] = idx  # list slots strided in memory
    lists = wide[..., ::2][..., :3]
    assert not lists.flags.c_contiguous
    out = sa.tile_sparse(strided(q), strided(k), strided(v), idx, cnt)
    assert_close(out, ref.attention(q, k, v, ref.mask_from_tile_lists(idx, cnt, Lq, Lk, Hq))[0], "float32")
    qidx = random_query_lists(rng, B, Hkv, Lq, 3, kq=2)
    qwide = np.full((B, Hkv, Lq, 5), -1, dtype=np.int32)
    qwide[..., 1:3] = qidx
    out = sa.query_sparse(strided(q), k, strided(v), qwide[..., 1:3])
    assert_close(out, ref.attention(q, k, v, ref.mask_from_query_lists(qidx, Lk, Hq))[0], "float32")


def test_sparse_attention_dispatches_on_the_selection(rng):
    B, Lq, Lk, Hq, Hkv, D = 1, 17, 260, 4, 2, 16
    q, k, v = qkv(rng, B, Lq, Lk, Hq, Hkv, D)
    idx, cnt = random_tile_lists(rng, B, Hkv, 1, 3, kmax=2, empty_tile=False)
    bits = ref.tile_lists_to_block_bits(idx, cnt, Lk)
    qlists = random_query_lists(rng, B, Hkv, Lq, 3, kq=2)
    tlists = random_token_lists(rng, B, Hkv, Lq, Lk, kt=9)
    cases = [({}, None), ({"tiles": (idx, cnt)}, ref.mask_from_tile_lists(idx, cnt, Lq, Lk, Hq)),
             ({"bits": bits}, ref.mask_from_block_bits(bits, Lq, Lk, Hq)),
             ({"query_lists": qlists}, ref.mask_from_query_lists(qlists, Lk, Hq)),
             ({"token_lists": tlists}, ref.mask_from_token_lists(tlists, Lk, Hq))]
    for sel, mask in cases:
        out, lse = sa.sparse_attention(q, k, v, causal=True, return_lse=True, **sel)
        ref_out, ref_lse = ref.attention(q, k, v, mask, causal=True)
        assert_close(out, ref_out, "float32", what=str(list(sel)))
        assert_lse(lse, ref_lse)
    with pytest.raises(ValueError, match="at most one"):
        sa.sparse_attention(q, k, v, bits=bits, token_lists=tlists)


def test_trusted_skips_validation_but_computes_the_same(rng):
    q, k, v = qkv(rng, 1, 17, 300, 4, 1, 32)
    idx, cnt = random_tile_lists(rng, 1, 1, 1, 3, kmax=3)
    a = sa.tile_sparse(q, k, v, idx, cnt)
    b = sa.tile_sparse(q, k, v, idx, cnt, trusted=True)
    np.testing.assert_array_equal(a, b)
