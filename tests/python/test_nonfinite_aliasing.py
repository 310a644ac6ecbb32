"""Through the binding: NaN in, NaN out (a row with a NaN or +inf score, or a score overflowing
float32, gets NaN out and lse; rows that see no key keep 0 and -inf), and outputs that share memory
with an input are refused with sparse_attn.Error naming the operator, both arguments and the bytes
shared."""
import numpy as np
import pytest

import sparse_attn as sa

from _util import dtype_of, qkv


def _nan_rows(out, lse):
    """(rows of out all NaN per (b, i, h), rows of lse NaN per (b, h, i)) as boolean arrays."""
    return np.isnan(out.astype(np.float32)).all(axis=-1), np.isnan(lse)


def test_nan_in_one_query_row_gives_that_row_nan_in_every_executor(rng):
    q, k, v = qkv(rng, 1, 40, 40, 2, 1, 16)
    q[0, 7, 1, 3] = np.nan
    idx = np.tile(np.arange(40, dtype=np.int32), (1, 1, 40, 1))
    expected = np.zeros((1, 40, 2), bool)
    expected[0, 7, 1] = True
    for name, call in {
        "dense": lambda: sa.dense(q, k, v, causal=True, return_lse=True),
        "token_sparse": lambda: sa.token_sparse(q, k, v, idx, causal=True, return_lse=True),
        "gated": lambda: sa.gated(q, k, v, np.full((2, 1), -np.inf, np.float32), return_lse=True)[:2],
    }.items():
        out, lse = call()
        nan_out, nan_lse = _nan_rows(out, lse)
        assert (nan_out == expected).all(), name
        assert (nan_lse == expected.transpose(0, 2, 1)).all(), name
        assert not np.isnan(out[~expected]).any(), name
    out = sa.entmax(q, k, v, causal=True)
    assert (np.isnan(out).all(axis=-1) == expected).all()


def test_scores_that_overflow_float32_give_nan_not_an_empty_row(rng):
    q, k, v = qkv(rng, 1, 8, 8, 1, 1, 16, "bfloat16")
    q[0, 3, 0, 0] = 1e19
    k[0, 5, 0, 0] = 1e20
    q[0, :3, 0, 0] = q[0, 4:, 0, 0] = 0  # only query 3 meets the huge key element
    out, lse = sa.dense(q, k, v, return_lse=True)
    assert np.isnan(lse[0, 0, 3]) and np.isnan(out[0, 3].astype(np.float32)).all()
    assert np.isfinite(np.delete(lse[0, 0], 3)).all()
    # Scores of about +-60 times 1e37: every row's max overflows to +inf (with 128 keys each row has a
    # positive score; a row whose scores all overflowed to -inf would see no key).
    out, lse = sa.dense(*qkv(rng, 1, 8, 128, 1, 1, 16, scale=4.0), softmax_scale=1e37, return_lse=True)
    assert np.isnan(lse).all() and np.isnan(out).all()


def test_rows_that_see_no_key_stay_zero_and_minus_inf(rng):
    q, k, v = qkv(rng, 1, 30, 20, 1, 1, 16)
    q[0, 25, 0, 0] = np.nan
    out, lse = sa.dense(q, k, v, causal=True, return_lse=True)
    assert (out[0, :10] == 0).all() and (lse[0, 0, :10] == -np.inf).all()
    assert np.isnan(lse[0, 0, 25]) and np.isfinite(np.delete(lse[0, 0, 10:], 15)).all()


@pytest.mark.parametrize("op", ["dense", "token_sparse", "gated", "entmax"])
def test_out_sharing_memory_with_an_input_is_refused(rng, op):
    B, L, H, D = 1, 24, 2, 16
    q, k, v = qkv(rng, B, L, L, H, H, D)
    idx = np.tile(np.arange(L, dtype=np.int32), (B, H, L, 1))

    def call(q, out):
        return {
            "dense": lambda: sa.dense(q, k, v, causal=True, out=out),
            "token_sparse": lambda: sa.token_sparse(q, k, v, idx, causal=True, out=out),
            "gated": lambda: sa.gated(q, k, v, np.zeros((H, 1), np.float32), out=out),
            "entmax": lambda: sa.entmax(q, k, v, causal=True, out=out),
        }[op]()

    with pytest.raises(sa.Error, match=f"{op}: argument 'out': overlaps 'k' in memory: .* bytes shared"):
        call(q, k)
    buf = np.zeros((B, L + 1, H, D), np.float32)
    buf[:, :L] = q
    with pytest.raises(sa.Error, match=f"{op}: argument 'out': overlaps 'q'"):
        call(buf[:, :L], buf[:, 1:])  # q shifted by one row
    call(q, np.empty_like(q))  # a separate buffer is fine


def test_out_overlapping_the_token_lists_is_refused(rng):
    q, k, v = qkv(rng, 1, 1, 64, 1, 1, 16)
    idx = np.arange(64, dtype=np.int32).reshape(1, 1, 1, 64)
    out = idx.view(np.float32)[..., :16]
    with pytest.raises(sa.Error, match="token_sparse: argument 'out': overlaps 'tokens.idx'"):
        sa.token_sparse(q, k, v, idx, out=out)
    assert (idx.ravel() == np.arange(64)).all()  # refused before anything was written
