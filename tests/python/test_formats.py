import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import reference as ref

from _util import qkv, random_query_lists, random_tile_lists, random_token_lists


def test_problem_shape():
    p = sa.ProblemShape(B=2, Lq=200, Lk=1000, Hq=8, Hkv=2, D=64, causal=True)
    assert (p.Tq, p.Tk, p.group_size, p.offset) == (2, 8, 4, 800)
    assert p.visible(0, 800) and not p.visible(0, 801)
    assert p.key_end(0) == 801
    assert p.visible_pairs() == sum(min(1000, i + 801) for i in range(200))
    q = np.zeros((2, 200, 8, 64), np.float32)
    k = np.zeros((2, 1000, 2, 64), np.float32)
    s = sa.problem_shape(q, k, causal=True)
    assert (s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.D, s.causal) == (2, 200, 1000, 8, 2, 64, True)
    assert "200" in repr(s)


def test_tile_lists_block_bits_round_trip(rng):
    p = sa.ProblemShape(2, 300, 5000, 4, 2, 32)
    idx, cnt = random_tile_lists(rng, 2, 2, p.Tq, p.Tk, kmax=6)
    bits = sa.tile_lists_to_block_bits(idx, cnt, p)
    assert bits.dtype == np.uint32 and bits.shape == (2, 2, 3, 2)  # Tk = 40 blocks -> 2 words
    np.testing.assert_array_equal(bits, ref.tile_lists_to_block_bits(idx, cnt, p.Lk))
    back_idx, back_cnt = sa.block_bits_to_tile_lists(bits, p, kmax=6)
    np.testing.assert_array_equal(back_cnt, cnt)
    for pos in np.ndindex(cnt.shape):
        np.testing.assert_array_equal(back_idx[pos][: cnt[pos]], idx[pos][: cnt[pos]])
    with pytest.raises(ValueError, match=r"block_bits_to_tile_lists: argument 'out\.idx'.*\[0, 0, 0\]"):
        sa.block_bits_to_tile_lists(bits, p, kmax=1)  # a tile holds more blocks than fit


def test_query_lists_to_tile_lists_is_the_union(rng):
    p = sa.ProblemShape(2, 200, 1000, 2, 2, 16)
    lists = random_query_lists(rng, 2, 2, p.Lq, p.Tk, kq=2)
    idx, cnt = sa.query_lists_to_tile_lists(lists, p)
    for b, g, t in np.ndindex(cnt.shape):
        rows = lists[b, g, t * 128:(t + 1) * 128]
        expect = np.unique(rows[rows >= 0])
        np.testing.assert_array_equal(idx[b, g, t, : cnt[b, g, t]], expect)


@pytest.mark.parametrize("causal", [False, True])
def test_expand_mask_matches_reference_masks(rng, causal):
    p = sa.ProblemShape(2, 140, 300, 4, 2, 16, causal)
    vis = ref.causal_visibility(p.Lq, p.Lk, causal)
    idx, cnt = random_tile_lists(rng, 2, 4, p.Tq, p.Tk, kmax=2)   # G = Hq
    bits = ref.tile_lists_to_block_bits(idx, cnt, p.Lk)
    ql = random_query_lists(rng, 2, 2, p.Lq, p.Tk, kq=2)
    tl = random_token_lists(rng, 2, 2, p.Lq, p.Lk, kt=30)
    cases = {"dense": ({}, np.ones((2, 4, p.Lq, p.Lk), bool)),
             "tiles": ({"tiles": (idx, cnt)}, ref.mask_from_tile_lists(idx, cnt, p.Lq, p.Lk, p.Hq)),
             "bits": ({"bits": bits}, ref.mask_from_block_bits(bits, p.Lq, p.Lk, p.Hq)),
             "query": ({"query_lists": ql}, ref.mask_from_query_lists(ql, p.Lk, p.Hq)),
             "token": ({"token_lists": tl}, ref.mask_from_token_lists(tl, p.Lk, p.Hq))}
    for name, (sel, expect) in cases.items():
        mask = sa.expand_mask(p, **sel)
        assert mask.dtype == np.uint8 and mask.shape == (2, 4, p.Lq, p.Lk), name
        np.testing.assert_array_equal(mask.astype(bool), expect & vis, err_msg=name)


def test_validate_accepts_valid_and_names_the_first_bad_coordinate(rng):
    p = sa.ProblemShape(1, 300, 1000, 2, 1, 16)
    idx, cnt = random_tile_lists(rng, 1, 1, p.Tq, p.Tk, kmax=4, empty_tile=False)
    sa.validate(p, tiles=(idx, cnt))
    bad = idx.copy()
    bad[0, 0, 1, 0] = 40
    with pytest.raises(ValueError, match=r"tiles\.idx.*40.*\[0, 0, 1, 0\]"):
        sa.validate(p, tiles=(bad, cnt), op="my_op")
    with pytest.raises(ValueError, match=r"^my_op: "):
        sa.validate(p, tiles=(bad, cnt), op="my_op")
    dup = idx.copy()
    dup[0, 0, 0, :2] = [3, 3]
    cnt2 = cnt.copy()
    cnt2[0, 0, 0] = max(2, cnt2[0, 0, 0])
    with pytest.raises(ValueError, match=r"tiles\.idx"):
        sa.validate(p, tiles=(dup, cnt2))
    over = cnt.copy()
    over[0, 0, 2] = 5
    with pytest.raises(ValueError, match=r"tiles\.cnt"):
        sa.validate(p, tiles=(idx, over))
    bits = ref.tile_lists_to_block_bits(idx, cnt, p.Lk)
    sa.validate(p, bits=bits)
    bits[0, 0, 0, 0] |= np.uint32(1 << 20)  # block 20 >= Tk = 8
    with pytest.raises(ValueError, match=r"bits"):
        sa.validate(p, bits=bits)
    ql = random_query_lists(rng, 1, 1, p.Lq, p.Tk, kq=3)
    sa.validate(p, query_lists=ql)
    ql[0, 0, 5, 0] = 8
    with pytest.raises(ValueError, match=r"lists\.idx.*\[0, 0, 5, 0\]"):
        sa.validate(p, query_lists=ql)
    tl = random_token_lists(rng, 1, 1, p.Lq, p.Lk, kt=3)
    sa.validate(p, token_lists=tl)
    tl[0, 0, 7, 2] = -5
    with pytest.raises(ValueError, match=r"tokens\.idx"):
        sa.validate(p, token_lists=tl)


def test_executors_reject_invalid_lists_with_coordinates(rng):
    q, k, v = qkv(rng, 1, 17, 300, 2, 1, 16)
    idx = np.array([[[[0, 3, -1]]]], dtype=np.int32)
    cnt = np.array([[[2]]], dtype=np.int32)
    with pytest.raises(ValueError, match=r"tile_sparse: argument 'tiles\.idx'.*3.*\[0, 0, 0, 1\]"):
        sa.tile_sparse(q, k, v, idx, cnt)
    unsorted = np.array([[[[2, 1, -1]]]], dtype=np.int32)
    with pytest.raises(ValueError, match=r"tiles\.idx"):
        sa.tile_sparse(q, k, v, unsorted, cnt)
    ql = np.full((1, 1, 17, 2), -1, np.int32)
    ql[0, 0, 4] = [1, 1]
    with pytest.raises(ValueError, match=r"query_sparse: argument 'lists\.idx'.*\[0, 0, 4, 1\]"):
        sa.query_sparse(q, k, v, ql)
    tl = np.full((1, 1, 17, 2), -1, np.int32)
    tl[0, 0, 16, 0] = 300
    with pytest.raises(ValueError, match=r"token_sparse: argument 'tokens\.idx'.*300"):
        sa.token_sparse(q, k, v, tl)


@pytest.mark.parametrize("causal", [False, True])
def test_evaluate_against_reference(rng, causal):
    B, Lq, Lk, Hq, Hkv, D = 1, 140, 300, 4, 2, 16
    q, k, v = qkv(rng, B, Lq, Lk, Hq, Hkv, D)
    idx, cnt = random_tile_lists(rng, B, Hkv, 2, 3, kmax=2, empty_tile=False)
    tl = random_token_lists(rng, B, Hkv, Lq, Lk, kt=50, empty_row=False)
    cases = [({"tiles": (idx, cnt)}, ref.mask_from_tile_lists(idx, cnt, Lq, Lk, Hq)),
             ({"token_lists": tl}, ref.mask_from_token_lists(tl, Lk, Hq))]
    for sel, mask in cases:
        r = sa.evaluate(q, k, v, causal=causal, **sel)
        e = ref.selection_quality(q, k, v, mask, causal=causal)
        for key in ("kept_mass_mean", "kept_mass_min", "out_rel_err", "token_sparsity", "block_sparsity"):
            assert r[key] == pytest.approx(e[key], rel=1e-5, abs=1e-7), key
        for key in ("kept_mass_mean_per_head", "kept_mass_min_per_head", "out_rel_err_per_head"):
            np.testing.assert_allclose(r[key], e[key], rtol=1e-5, atol=1e-7, err_msg=key)
        assert (r["selected_pairs"], r["visible_pairs"]) == (e["selected_pairs"], e["visible_pairs"])
    dense = sa.evaluate(q, k, v, causal=causal)
    assert dense["kept_mass_min"] == pytest.approx(1.0) and dense["out_rel_err"] == pytest.approx(0.0, abs=1e-12)
