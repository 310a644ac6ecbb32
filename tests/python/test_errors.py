"""Bad input raises sparse_attn.Error, a ValueError whose message names the operator, the argument
and the offending value; nothing is written and nothing crashes."""

import numpy as np
import pytest

import sparse_attn as sa

from _util import qkv


def _raises(fn, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        fn()
    assert isinstance(info.value, sa.Error)
    return str(info.value)


def test_error_is_a_value_error():
    assert issubclass(sa.Error, ValueError)


def test_wrong_dtype_names_the_argument(rng):
    q, k, v = qkv(rng, 1, 4, 8, 2, 1, 16)
    _raises(lambda: sa.dense(q.astype(np.float64), k, v), r"dense: argument 'q'.*f64")
    _raises(lambda: sa.dense(q, k.astype(np.float16), v), r"dense: argument 'k'.*f16")
    _raises(lambda: sa.dense(q, k, v.astype(np.int64)), r"dense: argument 'v': unsupported dtype int64")
    _raises(lambda: sa.dense(q, k, v, out=np.empty(q.shape, np.float16)), r"dense: argument 'out'")
    idx = np.zeros((1, 1, 1, 1), np.int64)
    cnt = np.ones((1, 1, 1), np.int32)
    _raises(lambda: sa.tile_sparse(q, k, v, idx, cnt), r"tile_sparse: argument 'tiles\.idx'.*int64")
    _raises(lambda: sa.bits_sparse(q, k, v, np.zeros((1, 1, 1, 1), np.int32)), r"bits_sparse: argument 'bits")


def test_wrong_shapes_name_the_argument(rng):
    q, k, v = qkv(rng, 1, 4, 8, 3, 2, 16)
    _raises(lambda: sa.dense(q, k, v), r"dense: argument 'k'.*query heads \(3\).*KV heads \(2\)")
    q, k, v = qkv(rng, 1, 4, 8, 2, 1, 16)
    _raises(lambda: sa.dense(q, k[..., :8], v), r"dense: argument 'k'")
    _raises(lambda: sa.dense(q, k, v[:, :7]), r"dense: argument 'v'")
    _raises(lambda: sa.dense(q[0], k, v), r"dense: argument 'q': expected 4 dimensions")
    _raises(lambda: sa.dense(q, k, v, out=np.empty((1, 4, 2, 8), np.float32)), r"dense: argument 'out'")


def test_last_dim_must_be_contiguous(rng):
    q, k, v = qkv(rng, 1, 4, 8, 2, 1, 32)
    _raises(lambda: sa.dense(q[..., ::2], k[..., ::2], v[..., ::2]), r"dense: argument 'q'.*contiguous")


def test_not_an_array():
    _raises(lambda: sa.dense([[1.0]], None, None), r"dense: argument 'q': expected an array")


def test_read_only_out_is_rejected_not_copied(rng):
    q, k, v = qkv(rng, 1, 4, 8, 2, 1, 16)
    out = np.zeros(q.shape, np.float32)
    out.flags.writeable = False
    _raises(lambda: sa.dense(q, k, v, out=out), r"dense: argument 'out': is read-only")
    assert np.all(out == 0)


def test_bad_options(rng):
    q, k, v = qkv(rng, 1, 4, 8, 2, 1, 16)
    _raises(lambda: sa.dense(q, k, v, softmax_scale=-1.0), r"dense: argument 'softmax_scale'.*-1")
    _raises(lambda: sa.dense(q, k, v, softmax_scale=float("nan")), r"softmax_scale")
    _raises(lambda: sa.query_sparse(q, k, v, np.full((1, 1, 4, 1), -1, np.int32), partials="f8"),
            r"query_sparse: argument 'partials'.*'f8'")
    _raises(lambda: sa.query_sparse(q, k, v, np.full((1, 1, 4, 1), -1, np.int32), merge_window=9),
            r"query_sparse: argument 'options.merge_window'.*9")
    _raises(lambda: sa.token_max_select(q, k, precision="int4"), r"token_max_select: argument 'precision'.*'int4'")
    _raises(lambda: sa.token_max_select(q, k, format="rows"), r"token_max_select: argument 'format'")
    _raises(lambda: sa.entmax(q, k, v, alpha=1.0), r"entmax: argument '[^']*alpha'")
    _raises(lambda: sa.pooled_select(q, k, representatives=3), r"pooled_select: argument '[^']*representatives'.*3")
    _raises(lambda: sa.pooled_select(q, k, top_k=0), r"pooled_select: argument '[^']*top_k'")


def test_bad_ids_name_the_coordinate(rng):
    q, k, v = qkv(rng, 2, 4, 300, 2, 1, 16)
    idx = np.zeros((2, 1, 1, 2), np.int32)
    idx[1, 0, 0] = [1, 7]
    cnt = np.full((2, 1, 1), 2, np.int32)
    idx[0, 0, 0] = [0, 2]
    msg = _raises(lambda: sa.tile_sparse(q, k, v, idx, cnt), r"tile_sparse: argument 'tiles\.idx'")
    assert "7" in msg and "[1, 0, 0, 1]" in msg
    _raises(lambda: sa.tile_sparse(q, k, v, idx, cnt[:1]), r"tile_sparse: argument 'tiles\.cnt'")


def test_gated_threshold_shape(rng):
    q, k, v = qkv(rng, 1, 130, 130, 2, 1, 16)
    _raises(lambda: sa.gated(q, k, v, np.zeros((3, 2), np.float32)), r"gated: argument 'thresholds'")
    _raises(lambda: sa.gated(q, k, v, np.zeros((2, 2), np.float64)), r"gated: argument 'thresholds'")


def test_conversions_reject_bad_input(rng):
    with pytest.raises(TypeError):
        sa.float_to_e4m3(np.zeros(3, np.float64))  # no silent conversion of the dtype
    p = sa.ProblemShape(1, 10, 10, 1, 1, 8)
    _raises(lambda: sa.validate(p, tiles=(np.zeros((1, 1, 1, 1), np.int32),)), r"'tiles': expected a pair")
    _raises(lambda: sa.validate(p, bits=np.zeros((1, 1, 1, 1), np.uint32), token_lists=np.zeros(1)),
            r"at most one")
