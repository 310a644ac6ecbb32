"""Shared helpers of the Python suite: fresh random inputs, poisoned outputs, error bounds."""

import inspect
import os
import pathlib

import numpy as np

import sparse_attn as sa
from sparse_attn import reference as ref

try:
    import ml_dtypes
except ImportError:  # bfloat16 numpy arrays need ml_dtypes
    ml_dtypes = None

# fp32 results against float64 references. Half precision outputs carry their own rounding (measured
# on the CPU: about 2e-4 for f16 and 1.7e-3 for bf16 relative error); GPU kernels also round the
# probabilities before PV, so the bounds allow about twice a plain same-precision implementation.
TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 6e-3}

# Public-domain English for the real-model tests: ../shared/data/texts beside the checkout (as CI lays it
# out), or SPARSE_ATTN_TEXTS. The tests that need it skip where it is absent.
TEXTS = pathlib.Path(os.environ.get("SPARSE_ATTN_TEXTS",
                                    pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data" / "texts"))


def dtype_of(name):
    if name == "bfloat16":
        if ml_dtypes is None:
            import pytest
            pytest.skip("ml_dtypes is not installed")
        return ml_dtypes.bfloat16
    return np.dtype(name)


def randn(rng, shape, dtype="float32", scale=1.0):
    """Fresh normal values rounded to dtype (never zeros)."""
    x = rng.standard_normal(shape) * scale
    return x.astype(dtype_of(dtype))


def qkv(rng, B, Lq, Lk, Hq, Hkv, D, dtype="float32", scale=1.0):
    return (randn(rng, (B, Lq, Hq, D), dtype, scale), randn(rng, (B, Lk, Hkv, D), dtype, scale),
            randn(rng, (B, Lk, Hkv, D), dtype))


def strided(x, rng=None):
    """The same values in a non-contiguous view: sequence and head dims of a larger buffer, the
    last dim contiguous."""
    B, L, H, D = x.shape
    big = np.empty((B, 2 * L + 1, H + 3, D), dtype=x.dtype)
    big[...] = np.asarray(1e4, dtype=np.float32).astype(x.dtype)
    view = big[:, 1::2, 2:2 + H]
    view[...] = x
    assert not view.flags.c_contiguous and view.strides[-1] == x.itemsize
    return view


def poisoned(shape, dtype):
    """An output buffer full of NaN (floating) or a sentinel (integer), to catch unwritten slots."""
    dt = dtype_of(dtype) if isinstance(dtype, str) else dtype
    a = np.empty(shape, dtype=dt)
    if np.dtype(dt).kind in "iu":
        a.fill(np.iinfo(np.dtype(dt)).max)
    else:
        a[...] = np.float32("nan")
    return a


def assert_close(out, expected, dtype, what="out"):
    assert np.all(np.isfinite(np.asarray(out).astype(np.float64))), f"{what} holds NaN/inf (not fully written?)"
    err = ref.rel_err(out, expected)
    assert err <= TOL[dtype if isinstance(dtype, str) else np.dtype(dtype).name], f"{what}: relerr {err:.3g}"


def assert_lse(lse, expected):
    lse = np.asarray(lse, dtype=np.float64)
    assert lse.dtype == np.float64 and lse.shape == expected.shape
    finite = np.isfinite(expected)
    assert np.array_equal(np.isfinite(lse), finite), "lse -inf pattern differs"
    assert np.all(lse[~finite] == -np.inf)
    if finite.any():
        assert np.max(np.abs(lse[finite] - expected[finite]) / np.maximum(1.0, np.abs(expected[finite]))) <= 1e-5


def random_tile_lists(rng, B, G, Tq, Tk, kmax, empty_tile=True):
    """Distinct ascending block ids, a different count per tile; one tile with zero blocks."""
    idx = np.full((B, G, Tq, kmax), -1, dtype=np.int32)
    cnt = np.zeros((B, G, Tq), dtype=np.int32)
    for b, g, t in np.ndindex(B, G, Tq):
        n = int(rng.integers(1, min(kmax, Tk) + 1))
        ids = np.sort(rng.choice(Tk, size=n, replace=False))
        idx[b, g, t, :n] = ids
        cnt[b, g, t] = n
    if empty_tile:
        cnt[0, 0, Tq - 1] = 0
        idx[0, 0, Tq - 1] = -1
    return idx, cnt


def random_query_lists(rng, B, Hkv, Lq, Tk, kq, empty_row=True):
    """Distinct block ids in random order with -1 holes; one query with an empty list."""
    idx = np.full((B, Hkv, Lq, kq), -1, dtype=np.int32)
    for b, g, i in np.ndindex(B, Hkv, Lq):
        n = int(rng.integers(0, min(kq, Tk) + 1))
        slots = rng.choice(kq, size=n, replace=False)
        idx[b, g, i, slots] = rng.choice(Tk, size=n, replace=False)
    if empty_row:
        idx[0, 0, 0] = -1
    return idx


def random_token_lists(rng, B, Hkv, Lq, Lk, kt, empty_row=True):
    idx = np.full((B, Hkv, Lq, kt), -1, dtype=np.int32)
    for b, g, i in np.ndindex(B, Hkv, Lq):
        n = int(rng.integers(0, min(kt, Lk) + 1))
        slots = rng.choice(kt, size=n, replace=False)
        idx[b, g, i, slots] = rng.choice(Lk, size=n, replace=False)
    if empty_row:
        idx[-1, -1, -1] = -1
    return idx


def check_top_k(selected, scores, k, tol, what):
    """`selected` (ids, -1 ignored) is a valid top-k of `scores` (-inf = not a candidate) up to `tol`
    in the scores: the right count, distinct candidates, and nothing left out that scores more than
    tol above something chosen."""
    sel = np.asarray(selected)
    sel = sel[sel >= 0]
    cand = np.isfinite(scores)
    assert len(sel) == min(k, int(cand.sum())), f"{what}: {len(sel)} selected, expected {min(k, int(cand.sum()))}"
    assert len(np.unique(sel)) == len(sel), f"{what}: duplicate ids {sel}"
    assert np.all(cand[sel]), f"{what}: selected a non-candidate among {sel}"
    rest = cand.copy()
    rest[sel] = False
    if len(sel) and rest.any():
        assert scores[rest].max() <= scores[sel].min() + tol, (
            f"{what}: left out a block scoring {scores[rest].max():.6g} > chosen minimum {scores[sel].min():.6g}")


def causal_defaults(module):
    """{name: default of `causal`} for every public function of `module` that takes `causal`."""
    found = {}
    for name in module.__all__:
        fn = getattr(module, name)
        if inspect.isfunction(fn) and "causal" in inspect.signature(fn).parameters:
            found[name] = inspect.signature(fn).parameters["causal"].default
    return found
