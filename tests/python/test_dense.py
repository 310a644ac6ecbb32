import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import reference as ref

from _util import assert_close, assert_lse, poisoned, qkv, strided

# (B, Lq, Lk, Hq, Hkv, D, causal)
SHAPES = [
    (1, 1, 1, 1, 1, 16, False),
    (2, 17, 200, 4, 1, 32, False),     # GQA 4, Lk not a multiple of 128
    (2, 17, 200, 4, 4, 32, True),      # Hq = Hkv, causal with Lq < Lk (bottom-right)
    (1, 1, 300, 16, 1, 64, True),      # one query (decode), Hq = 16 x Hkv
    (1, 130, 130, 2, 1, 64, True),     # two Q tiles, the second partial
    (1, 1013, 1100, 2, 1, 16, True),   # eight Q tiles and nine KV blocks, both partial
]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Lq{}_Lk{}_Hq{}_Hkv{}_D{}_{}".format(*s[:6], "causal" if s[6] else "full"))
def test_dense_matches_float64_reference(rng, shape, dtype):
    B, Lq, Lk, Hq, Hkv, D, causal = shape
    q, k, v = qkv(rng, B, Lq, Lk, Hq, Hkv, D, dtype)
    out, lse = sa.dense(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (B, Hq, Lq)
    ref_out, ref_lse = ref.attention(q, k, v, causal=causal)
    assert_close(out, ref_out, dtype)
    assert_lse(lse, ref_lse)


def test_dense_returns_out_only_without_return_lse(rng):
    q, k, v = qkv(rng, 1, 5, 9, 2, 1, 16)
    out = sa.dense(q, k, v)
    assert isinstance(out, np.ndarray) and out.shape == q.shape


def test_out_is_written_in_place(rng):
    q, k, v = qkv(rng, 2, 17, 140, 4, 2, 32)
    out = poisoned(q.shape, "float32")
    res, lse = sa.dense(q, k, v, out=out, return_lse=True, causal=True)
    assert res is out
    assert_close(out, ref.attention(q, k, v, causal=True)[0], "float32")


def test_out_may_be_strided(rng):
    q, k, v = qkv(rng, 1, 9, 40, 2, 1, 16)
    out = strided(poisoned(q.shape, "float32"))
    sa.dense(q, k, v, out=out)
    assert_close(out, ref.attention(q, k, v)[0], "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_strided_inputs(rng, dtype):
    q, k, v = qkv(rng, 2, 17, 150, 4, 2, 32, dtype)
    out, lse = sa.dense(strided(q), strided(k), strided(v), causal=True, return_lse=True)
    ref_out, ref_lse = ref.attention(q, k, v, causal=True)
    assert_close(out, ref_out, dtype)
    assert_lse(lse, ref_lse)


def test_softmax_scale(rng):
    q, k, v = qkv(rng, 1, 7, 33, 2, 2, 16)
    out = sa.dense(q, k, v, softmax_scale=0.05)
    assert_close(out, ref.attention(q, k, v, softmax_scale=0.05)[0], "float32")
    assert ref.rel_err(out, ref.attention(q, k, v)[0]) > 1e-3  # the scale matters


def test_queries_that_see_no_key_give_zero_and_minus_inf(rng):
    # Causal with Lq > Lk: the first Lq - Lk queries see nothing.
    q, k, v = qkv(rng, 1, 20, 5, 2, 1, 16)
    out, lse = sa.dense(q, k, v, causal=True, return_lse=True)
    assert np.all(out[0, :15] == 0)
    assert np.all(lse[0, :, :15] == -np.inf)
    ref_out, ref_lse = ref.attention(q, k, v, causal=True)
    assert_close(out, ref_out, "float32")
    assert_lse(lse, ref_lse)


def test_read_only_inputs_are_accepted(rng):
    q, k, v = qkv(rng, 1, 3, 10, 1, 1, 8)
    for a in (q, k, v):
        a.flags.writeable = False
    assert_close(sa.dense(q, k, v), ref.attention(q, k, v)[0], "float32")
