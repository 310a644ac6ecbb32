"""Hostile-input campaign: generates cases across categories (shapes, dtypes, strides, aliasing,
non-finite values, invalid selections, selector options, threshold files, CLI options), runs each
in its own subprocess with a timeout and classifies what happened:

  crash           the process died of a signal (or exited without reporting)
  hang            it ran past the timeout
  clear_error     an error whose message names the operator and the argument
  vague_error     an error lacking either
  correct         it returned and the result matches the CPU float64 reference (or is a valid
                  selection, a well-formed table), or a trusted call over a bad selection returned
  silently_wrong  it returned a result that differs from the reference, or accepted input that must
                  be refused

    python tests/campaign/run_campaign.py --cases 1500 --json campaign.json [--cli build/tools/sparse-attn]

Prints the counts per category and outcome and every vague error with its message. A case is
reproducible from (seed, index): `--only INDEX` runs one in the foreground.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

CATEGORIES = ("shapes", "dtypes", "strides", "aliasing", "non_finite", "invalid_selections", "options",
              "file_readers", "cli")
EXECUTORS = ("dense", "tile_sparse", "bits_sparse", "query_sparse", "token_sparse", "gated", "entmax")
SELECTORS = ("pooled_select", "token_max_select", "lightning_select")
CONVERSIONS = ("tile_lists_to_block_bits", "block_bits_to_tile_lists", "query_lists_to_tile_lists")
TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}


class Case:
    """One hostile call. expect: "refuse" (must raise), "either" (may raise; a result must be right),
    "no_crash" (a trusted call over a bad selection: any result or error is fine)."""

    def __init__(self, index, category, op, expect, names, what, run):
        self.index, self.category, self.op, self.expect = index, category, op, expect
        self.names, self.what, self.run = names, what, run


# ---- problems and selections --------------------------------------------------------------------

def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


class Problem:
    def __init__(self, rng, dtype="float32", causal=None, dims=(16, 32, 64)):
        import sparse_attn as sa
        self.B = int(rng.integers(1, 3))
        self.Hkv = int(rng.choice([1, 2]))
        self.Hq = self.Hkv * int(rng.choice([1, 2]))
        self.D = int(rng.choice(dims))
        self.Lq = int(rng.choice([1, 70, 130, 257]))
        self.Lk = int(rng.choice([1, 100, 200, 300]))
        self.causal = bool(rng.integers(2)) if causal is None else causal
        self.dtype = dtype
        self.Tq, self.Tk = -(-self.Lq // sa.TILE_Q), -(-self.Lk // sa.BLOCK_K)
        dt = _dtype(dtype)
        self.q = rng.standard_normal((self.B, self.Lq, self.Hq, self.D)).astype(dt)
        self.k = rng.standard_normal((self.B, self.Lk, self.Hkv, self.D)).astype(dt)
        self.v = rng.standard_normal((self.B, self.Lk, self.Hkv, self.D)).astype(dt)

    @staticmethod
    def of(q_shape, k_shape, causal):
        """The extents of q and k (a Problem without arrays)."""
        import sparse_attn as sa
        (B, Lq, Hq, D), (Bk, Lk, Hkv, Dk) = q_shape, k_shape
        if (B, D) != (Bk, Dk):
            raise ValueError(f"q {q_shape} and k {k_shape} disagree")
        p = Problem.__new__(Problem)
        p.B, p.Lq, p.Lk, p.Hq, p.Hkv, p.D, p.causal = B, Lq, Lk, Hq, Hkv, D, causal
        p.shape()  # refuses extents that make no problem
        return p

    def shape(self):
        import sparse_attn as sa
        return sa.ProblemShape(self.B, self.Lq, self.Lk, self.Hq, self.Hkv, self.D, self.causal)


def tile_lists(rng, p, G=None):
    G = G or p.Hkv
    kmax = int(rng.integers(1, p.Tk + 2))
    idx = np.full((p.B, G, p.Tq, kmax), -1, np.int32)
    cnt = np.zeros((p.B, G, p.Tq), np.int32)
    for b, g, t in np.ndindex(p.B, G, p.Tq):
        n = int(rng.integers(0, min(kmax, p.Tk) + 1))
        idx[b, g, t, :n] = np.sort(rng.choice(p.Tk, size=n, replace=False))
        cnt[b, g, t] = n
    return idx, cnt


def block_bits(rng, p, G=None):
    G = G or p.Hkv
    blocks = rng.random((p.B, G, p.Tq, p.Tk)) < 0.5
    words = np.zeros((p.B, G, p.Tq, -(-p.Tk // 32)), np.uint32)
    for j in range(p.Tk):
        words[..., j // 32] |= blocks[..., j].astype(np.uint32) << np.uint32(j % 32)
    return words


def query_lists(rng, p, width=None, n=None):
    width = width or int(rng.integers(1, p.Tk + 2))
    idx = np.full((p.B, p.Hkv, p.Lq, width), -1, np.int32)
    for b, g, i in np.ndindex(p.B, p.Hkv, p.Lq):
        m = int(rng.integers(0, min(width, n) + 1))
        slots = rng.choice(width, size=m, replace=False)
        idx[b, g, i, slots] = rng.choice(n, size=m, replace=False)
    return idx


def selection_for(rng, op, p):
    """The arrays of a valid selection of executor op, by argument name."""
    if op == "tile_sparse":
        idx, cnt = tile_lists(rng, p, int(rng.choice([p.Hkv, p.Hq])))
        return {"idx": idx, "cnt": cnt}
    if op == "bits_sparse":
        return {"bits": block_bits(rng, p, int(rng.choice([p.Hkv, p.Hq])))}
    if op == "query_sparse":
        return {"idx": query_lists(rng, p, n=p.Tk)}
    if op == "token_sparse":
        return {"idx": query_lists(rng, p, width=int(rng.integers(1, 40)), n=p.Lk)}
    return {}


# ---- running one call and judging its result -----------------------------------------------------

class Refused(Exception):
    """A result that shows the call accepted what it must refuse, or returned a wrong answer."""


def rel_err(x, expected):
    x, expected = np.asarray(x, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(x - expected) / max(np.linalg.norm(expected), 1e-300))


def compare_rows(out, expected, dtype, nan_rows, any_rows, what="out"):
    """Rows (b, i, h) in nan_rows must hold NaN (NaN in gives NaN out); rows in any_rows (an inf, or a
    NaN whose reach depends on the data) may hold anything; every other row must match."""
    out = np.asarray(out).astype(np.float64)
    got_bad = ~np.isfinite(out).all(axis=-1)
    if np.any(nan_rows & ~any_rows & ~got_bad):
        raise Refused(f"{what}: finite where NaN reached the row (NaN in must give NaN out)")
    check = ~nan_rows & ~any_rows
    if np.any(check & got_bad):
        raise Refused(f"{what}: NaN/inf in a row that no non-finite input reaches")
    err = rel_err(np.where(check[..., None], out, 0), np.where(check[..., None], expected, 0))
    if err > TOL[dtype]:
        raise Refused(f"{what}: relative error {err:.3g} > {TOL[dtype]}")


def reference_mask(op, arrays, Lq, Lk, Hq):
    from sparse_attn import reference as ref
    if op == "tile_sparse":
        return ref.mask_from_tile_lists(arrays["idx"], arrays["cnt"], Lq, Lk, Hq)
    if op == "bits_sparse":
        return ref.mask_from_block_bits(arrays["bits"], Lq, Lk, Hq)
    if op == "query_sparse":
        return ref.mask_from_query_lists(arrays["idx"], Lk, Hq)
    if op == "token_sparse":
        return ref.mask_from_token_lists(arrays["idx"], Lk, Hq)
    return None


def expected_output(op, arrays, kwargs):
    """(float64 reference out, rows NaN must reach, rows left free) of the arrays as given; raises
    Refused when the arrays do not make a problem (so a call that accepted them was wrong)."""
    from sparse_attn import reference as ref
    host = {n: np.asarray(x).astype(np.float64) for n, x in arrays.items() if n in ("q", "k", "v")}
    q, k, v = host["q"], host["k"], host["v"]
    try:
        B, Lq, Hq, D = q.shape
        _, Lk, Hkv, _ = k.shape
        if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or Hkv < 1 or Hq % Hkv:
            raise ValueError("not one problem")
        if q.size == 0 or Lk == 0:  # nothing to compute, or no key to see: out = 0
            return np.zeros(q.shape), np.zeros(q.shape[:3], bool), np.zeros(q.shape[:3], bool)
        clean = {n: np.where(np.isfinite(x), x, 0.0) for n, x in host.items()}
        scale = kwargs.get("softmax_scale")
        causal = kwargs.get("causal", False)
        if op == "gated":
            expected = ref.gated(clean["q"], clean["k"], clean["v"], arrays["thresholds"], scale)[0]
            causal = True
        elif op == "entmax":
            expected = ref.entmax_attention(clean["q"], clean["k"], clean["v"], kwargs.get("alpha", 1.5), scale,
                                            causal)[0]
        else:
            mask = reference_mask(op, arrays, Lq, Lk, Hq)
            expected = ref.attention(clean["q"], clean["k"], clean["v"], mask, scale, causal)[0]
    except (ValueError, IndexError, TypeError, KeyError, ArithmeticError) as e:
        raise Refused(f"accepted arrays that make no problem ({e})")
    # Which rows a non-finite input reaches: its query row if that row sees any key, and the rows that
    # see a key holding one (a row that sees no key computes no score: out 0, lse -inf).
    seen = ref.causal_visibility(Lq, Lk, causal)[None, None]
    mask = reference_mask(op, arrays, Lq, Lk, Hq)
    exact = mask is not None or op == "dense"
    if mask is not None:
        seen = seen & mask
    seen = np.broadcast_to(seen, (B, Hq, Lq, Lk))
    rows = {}
    for kind in ("nan", "inf"):
        test = np.isnan if kind == "nan" else np.isinf
        bad_q = test(q).any(-1).transpose(0, 2, 1) & seen.any(-1)                   # (B, Hq, Lq)
        bad_key = (test(k) | test(v)).any(-1)                                        # (B, Lk, Hkv)
        bad_key = np.repeat(bad_key, Hq // Hkv, axis=2).transpose(0, 2, 1)           # (B, Hq, Lk)
        reached = bad_q | (seen & bad_key[:, :, None, :]).any(-1)
        rows[kind] = reached.transpose(0, 2, 1)                                      # (B, Lq, Hq)
    nan_rows = rows["nan"]
    any_rows = rows["inf"] | (np.zeros_like(nan_rows) if exact else nan_rows)
    # A non-finite v may also reach the rows that visit its 128-key block without seeing the key
    # itself (a masked key's weight 0 times NaN or inf is NaN; docs/design.md §2).
    Tk = -(-Lk // 128)
    pad = Tk * 128 - Lk
    bad_v = ~np.isfinite(v).all(-1)                                                   # (B, Lk, Hkv)
    bad_v = np.pad(bad_v, ((0, 0), (0, pad), (0, 0))).reshape(B, Tk, 128, Hkv).any(2)
    bad_v = np.repeat(bad_v, Hq // Hkv, axis=2).transpose(0, 2, 1)                     # (B, Hq, Tk)
    seen_blocks = np.pad(seen, ((0, 0), (0, 0), (0, 0), (0, pad))).reshape(B, Hq, Lq, Tk, 128).any(-1)
    any_rows = any_rows | (seen_blocks & bad_v[:, :, None, :]).any(-1).transpose(0, 2, 1)
    return expected, nan_rows, any_rows


def tolerance_dtype(arrays):
    names = [dtype_name(arrays[n]) for n in ("q", "k", "v") if n in arrays]
    for d in ("bfloat16", "float16"):
        if d in names:
            return d
    return "float32"


def dtype_name(a):
    return np.dtype(a.dtype).name if not str(a.dtype).startswith("bfloat16") else "bfloat16"


def to_device(x, device):
    """numpy -> torch CUDA for device="cuda" (bfloat16 through its bits)."""
    if device == "cpu" or not isinstance(x, np.ndarray):
        return x
    import torch
    if str(x.dtype) == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(x)).to(device)


def to_host(x):
    if type(x).__module__.startswith("torch"):
        if str(x.dtype) == "torch.bfloat16":
            return x.float().cpu().numpy()
        return x.cpu().numpy()
    return x


def run_executor(op, p, arrays, kwargs, device):
    """Calls executor `op` on the arrays; checks the result against the float64 reference of the same
    arrays."""
    import sparse_attn as sa
    try:  # before the call: out may overwrite an input
        reference = expected_output(op, arrays, kwargs)
    except Refused as e:
        reference = e
    a = {n: to_device(x, device) for n, x in arrays.items()}
    if op == "gated":
        out = sa.gated(a["q"], a["k"], a["v"], a["thresholds"], **kwargs)[0]
    elif op == "entmax":
        out = sa.entmax(a["q"], a["k"], a["v"], **kwargs)
    else:
        sel = [a[n] for n in ("idx", "cnt", "bits") if n in a]
        out = getattr(sa, op)(a["q"], a["k"], a["v"], *sel, **kwargs)
    if isinstance(out, tuple):
        out = out[0]
    if isinstance(reference, Refused):
        raise reference
    expected, nan_rows, any_rows = reference
    if out.shape != expected.shape:
        raise Refused(f"out has shape {list(out.shape)}, the reference {list(expected.shape)}")
    compare_rows(to_host(out), expected, tolerance_dtype(arrays), nan_rows, any_rows)


def check_tiles(p, idx, cnt, top_k=None):
    """A selector's TileLists: valid for the problem, counts within top_k."""
    import sparse_attn as sa
    idx, cnt = to_host(idx), to_host(cnt)
    try:
        sa.validate(p.shape(), tiles=(idx, cnt))
    except sa.Error as e:
        raise Refused(f"the selector wrote an invalid selection: {e}")
    if top_k is not None and np.any(cnt > top_k):
        raise Refused(f"a count {int(cnt.max())} exceeds top_k = {top_k}")


def check_lists(p, idx, kind, top_k=None):
    import sparse_attn as sa
    idx = to_host(idx)
    if idx.shape[1] != p.Hkv:  # lightning_select writes `groups` copies
        idx = idx[:, :1].repeat(p.Hkv, axis=1)
    try:
        sa.validate(p.shape(), **{kind: idx})
    except sa.Error as e:
        raise Refused(f"the selector wrote an invalid selection: {e}")
    if top_k is not None and np.any((idx >= 0).sum(-1) > top_k):
        raise Refused(f"more than top_k = {top_k} entries in a list")


def run_selector(op, p, arrays, kwargs, device):
    import sparse_attn as sa
    a = {n: to_device(x, device) for n, x in arrays.items()}
    top_k = kwargs.get("top_k")
    top_k = top_k if isinstance(top_k, (int, np.integer)) and not isinstance(top_k, bool) else None
    if op == "pooled_select":
        idx, cnt = sa.pooled_select(a["q"], a["k"], **kwargs)
        q, k = arrays["q"], arrays["k"]
        try:  # the problem the arrays make (a grown q is another valid problem)
            p = Problem.of(q.shape, k.shape, kwargs.get("causal", False))
        except (sa.Error, ValueError) as e:
            raise Refused(f"accepted arrays that make no problem ({e})")
        check_tiles(p, idx, cnt, top_k)
    elif op == "token_max_select":
        res = sa.token_max_select(a["qidx"], a["kidx"], **kwargs)
        if kwargs.get("format", "query") == "tile":
            check_tiles(p, *res, None)
        else:
            check_lists(p, res, "query_lists", top_k)
    else:
        res = sa.lightning_select(a["qI"], a["w"], a["kI"], **kwargs)
        kind = "query_lists" if kwargs.get("format") == "query" else "token_lists"
        check_lists(p, res, kind, top_k)


def selector_inputs(rng, op, p):
    if op == "pooled_select":
        return {"q": p.q, "k": p.k}
    if op == "token_max_select":
        di = int(rng.choice([16, 32]))
        return {"qidx": rng.standard_normal((p.B, p.Lq, p.Hkv, di)).astype(np.float32),
                "kidx": rng.standard_normal((p.B, p.Lk, 1, di)).astype(np.float32)}
    hi, di = int(rng.choice([1, 4])), int(rng.choice([16, 32]))
    return {"qI": rng.standard_normal((p.B, p.Lq, hi, di)).astype(np.float32),
            "w": rng.standard_normal((p.B, p.Lq, hi)).astype(np.float32),
            "kI": rng.standard_normal((p.B, p.Lk, di)).astype(np.float32)}


def run_conversion(op, p, arrays, kwargs, device):
    import sparse_attn as sa
    from sparse_attn import reference as ref
    a = {n: to_device(x, device) for n, x in arrays.items()}
    shape = p.shape()
    if op == "tile_lists_to_block_bits":
        bits = to_host(sa.tile_lists_to_block_bits(a["idx"], a["cnt"], shape, **kwargs))
        want = ref.mask_from_tile_lists(arrays["idx"], arrays["cnt"], p.Lq, p.Lk, p.Hq)
        got = ref.mask_from_block_bits(bits, p.Lq, p.Lk, p.Hq)
    elif op == "block_bits_to_tile_lists":
        idx, cnt = (to_host(x) for x in sa.block_bits_to_tile_lists(a["bits"], shape, **kwargs))
        want = ref.mask_from_block_bits(arrays["bits"], p.Lq, p.Lk, p.Hq)
        got = ref.mask_from_tile_lists(idx, cnt, p.Lq, p.Lk, p.Hq)
    else:
        idx, cnt = (to_host(x) for x in sa.query_lists_to_tile_lists(a["idx"], shape, **kwargs))
        # The tile of each query holds at least the blocks of its list.
        want = ref.mask_from_query_lists(arrays["idx"], p.Lk, p.Hq)
        got = ref.mask_from_tile_lists(idx, cnt, p.Lq, p.Lk, p.Hq)
        if np.any(want & ~got):
            raise Refused("a block of a query's list is missing from its tile")
        return
    if not np.array_equal(want, got):
        raise Refused("the converted selection differs from its input")


# ---- case generators, one per category ----------------------------------------------------------

def _executor_call(rng, op, p, device):
    """(arrays, kwargs) of a valid call of executor op."""
    sel = selection_for(rng, op, p)
    arrays = {"q": p.q, "k": p.k, "v": p.v, **sel}
    kwargs = {}
    if op == "gated":
        p.causal = True
        arrays["thresholds"] = rng.standard_normal((p.Hq, max(p.Tq, 1))).astype(np.float32)
    else:
        kwargs["causal"] = p.causal
    return arrays, kwargs


def _new_problem(rng, dtype="float32", op=None, dims=(16, 32, 64)):
    p = Problem(rng, dtype, causal=True if op == "gated" else None, dims=dims)
    if op in ("gated", "entmax") and p.Lq != p.Lk:  # gated is causal over Lq = Lk
        p.Lk = p.Lq
        p.Tk = p.Tq
        p.k, p.v = p.k[:, :1].repeat(p.Lq, 1), p.v[:, :1].repeat(p.Lq, 1)
        p.k = (p.k + rng.standard_normal(p.k.shape)).astype(p.k.dtype)
    return p


def gen_shapes(rng, index, device):
    op = str(rng.choice(EXECUTORS + SELECTORS[:1]))
    p = _new_problem(rng, op=op)
    arrays, kwargs = (_executor_call(rng, op, p, device) if op in EXECUTORS
                            else ({"q": p.q, "k": p.k}, {"top_k": 2}))
    name = str(rng.choice([n for n in arrays if n != "thresholds" or op == "gated"]))
    x = arrays[name]
    kind = str(rng.choice(["drop_dim", "add_dim", "grow", "shrink", "zero"]))
    axis = int(rng.integers(x.ndim))
    if kind == "drop_dim":
        y = x[(slice(None),) * axis + (0,)]
    elif kind == "add_dim":
        y = x[..., None]
    elif kind == "grow":
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, 1)
        y = np.pad(x, pad, constant_values=np.zeros((), x.dtype))
    elif kind == "shrink":
        if x.shape[axis] < 2:
            y = x[(slice(None),) * axis + (slice(0, 0),)]
        else:
            y = x[(slice(None),) * axis + (slice(0, x.shape[axis] - 1),)]
    else:
        y = x[(slice(None),) * axis + (slice(0, 0),)]
    arrays[name] = np.ascontiguousarray(y)
    names = [name, "q", "k", "v", "idx", "cnt", "bits", "thresholds"]

    def run():
        if op in EXECUTORS:
            run_executor(op, p, arrays, kwargs, device)
        else:
            run_selector(op, p, arrays, kwargs, device)
    # Some changes make another valid problem (one more query, a wider list): the result must then match.
    return Case(index, "shapes", op, "either", names, f"{name} {kind} axis {axis}: {x.shape} -> {y.shape}", run)


def gen_dtypes(rng, index, device):
    op = str(rng.choice(EXECUTORS + SELECTORS + CONVERSIONS[:1]))
    base = str(rng.choice(["float32", "float16", "bfloat16"])) if op in EXECUTORS else "float32"
    p = _new_problem(rng, base, op)
    if op in EXECUTORS:
        arrays, kwargs = _executor_call(rng, op, p, device)
    elif op in SELECTORS:
        arrays, kwargs = selector_inputs(rng, op, p), {"top_k": 2}
    else:
        idx, cnt = tile_lists(rng, p)
        arrays, kwargs = {"idx": idx, "cnt": cnt}, {}
    name = str(rng.choice(list(arrays)))
    to = str(rng.choice(["float64", "int64", "int32", "uint32", "int8", "bool", "complex64", "float16",
                         "bfloat16", "float32", ">f4", ">i4", "object", "uint8"]))
    x = arrays[name]
    with np.errstate(invalid="ignore"):
        try:
            y = x.astype(_dtype(to) if to != "object" else object)
        except (TypeError, ValueError):
            y = x.astype(np.float64).astype(_dtype(to))
    if str(y.dtype) == str(x.dtype):
        y = x.astype(np.int64)
    arrays[name] = y
    floats = ("float32", "float16", "bfloat16")
    # q, k, v (and a selector's inputs) in another of the three float types may be accepted, then right.
    expect = "either" if dtype_name(x) in floats and dtype_name(y) in floats else "refuse"
    names = [name] + list(arrays)  # a mismatch may be named on either side ("k: dtype f32 differs from q's")

    def run():
        if op in EXECUTORS:
            run_executor(op, p, arrays, kwargs, device)
        elif op in SELECTORS:
            run_selector(op, p, arrays, kwargs, device)
        else:
            run_conversion(op, p, arrays, kwargs, device)
    # An index array must keep its dtype; q, k, v must share one of float32, float16, bfloat16.
    return Case(index, "dtypes", op, expect, names, f"{name} {x.dtype} -> {y.dtype}", run)


def gen_strides(rng, index, device):
    op = str(rng.choice(EXECUTORS + SELECTORS[:1]))
    p = _new_problem(rng, op=op)
    arrays, kwargs = (_executor_call(rng, op, p, device) if op in EXECUTORS
                            else ({"q": p.q, "k": p.k}, {"top_k": 2}))
    name = str(rng.choice(["q", "k", "v", "out"] if op in EXECUTORS and op != "gated" else ["q", "k"]))
    kind = str(rng.choice(["last_dim", "padded", "reversed", "broadcast", "transposed"]))
    x = p.q if name == "out" else arrays[name]
    expect = "either"
    if kind == "last_dim":  # a non-contiguous last dimension is refused
        big = np.repeat(x, 2, axis=-1)
        y = big[..., ::2]
        expect = "refuse" if x.shape[-1] > 1 and name != "out" else "either"
    elif kind == "padded":  # free strides on the other dimensions
        big = np.zeros(x.shape[:-2] + (x.shape[-2] + 3, x.shape[-1]), x.dtype)
        y = big[..., 1:1 + x.shape[-2], :]
        y[...] = x
    elif kind == "reversed":  # negative strides
        y = x[:, ::-1]
    elif kind == "broadcast":  # zero strides
        y = np.broadcast_to(x[:, :1], x.shape)
        expect = "refuse" if name == "out" and x.shape[1] > 1 else "either"
    else:
        y = np.ascontiguousarray(np.swapaxes(x, 1, 2)).swapaxes(1, 2)
    if name != "out":
        arrays[name] = y
    else:
        y = y.copy() if kind != "broadcast" else y
        kwargs["out"] = y

    def run():
        if device != "cpu" and name == "out":
            raise Refused("skipped: host out= views only on the CPU")
        if op in EXECUTORS:
            run_executor(op, p, arrays, kwargs, device)
        else:
            run_selector(op, p, arrays, kwargs, device)
    return Case(index, "strides", op, expect, [name], f"{name} {kind}", run)


def gen_aliasing(rng, index, device):
    op = str(rng.choice(("dense", "tile_sparse", "query_sparse", "token_sparse", "bits_sparse")))
    p = _new_problem(rng, op=op)
    p.Lk, p.Hkv, p.Hq = p.Lq, p.Hq, p.Hq  # q, k, v of one shape so that out can be any of them
    p.Tk = p.Tq
    p.k = rng.standard_normal(p.q.shape).astype(p.q.dtype)
    p.v = rng.standard_normal(p.q.shape).astype(p.q.dtype)
    arrays, kwargs = _executor_call(rng, op, p, device)
    target = str(rng.choice(["q", "k", "v", "k_shifted", "lse_in_out"]))
    if target == "k_shifted" and p.Lq < 2:  # one row shifted by one row only touches k: no overlap
        target = "k"
    if target in ("q", "k", "v"):
        kwargs["out"] = arrays[target] = arrays[target].copy()
    elif target == "k_shifted":  # out overlaps k partly (one row further in one buffer)
        L = p.Lq
        buf = np.zeros((p.B, L + 1, p.Hq, p.D), p.q.dtype)
        buf[:, :L] = p.k
        arrays["k"] = buf[:, :L]
        kwargs["out"] = buf[:, 1:]
    else:  # lse written into out's memory
        out = np.zeros(p.q.shape, np.float32)
        kwargs["out"] = out
        kwargs["return_lse"] = True
        lse_view = out.reshape(-1)[:p.B * p.Hq * p.Lq].reshape(p.B, p.Hq, p.Lq)
        arrays["lse"] = lse_view

    def run():
        if device != "cpu":
            raise Refused("skipped: host aliasing only on the CPU")
        if target == "lse_in_out":  # through the extension: the package allocates lse itself
            import sparse_attn as sa
            expected, nan_rows, any_rows = expected_output("dense", arrays, {"causal": p.causal})
            sa._ext.dense(p.q, p.k, p.v, kwargs["out"], arrays["lse"], causal=p.causal)
            compare_rows(kwargs["out"], expected, p.dtype, nan_rows, any_rows)
            return
        run_executor(op, p, arrays, kwargs, device)
    return Case(index, "aliasing", "dense" if target == "lse_in_out" else op, "refuse",
                ["out", "lse", "q", "k", "v"], f"out overlaps {target}", run)


def gen_non_finite(rng, index, device):
    op = str(rng.choice(EXECUTORS + SELECTORS[:2]))
    base = str(rng.choice(["float32", "float16"]))
    p = _new_problem(rng, base if op in EXECUTORS else "float32", op)
    value = float(rng.choice([np.nan, np.inf, -np.inf]))
    if op in EXECUTORS:
        arrays, kwargs = _executor_call(rng, op, p, device)
        name = str(rng.choice(["q", "k", "v"]))
    else:
        arrays, kwargs = selector_inputs(rng, op, p), {"top_k": 2}
        name = str(rng.choice(list(arrays)))
    x = arrays[name].copy()
    where = tuple(int(rng.integers(s)) for s in x.shape)
    x[where] = value
    arrays[name] = x

    def run():
        if op in EXECUTORS:
            run_executor(op, p, arrays, kwargs, device)
        else:
            run_selector(op, p, arrays, kwargs, device)
    return Case(index, "non_finite", op, "either", [name], f"{name}{list(where)} = {value}", run)


SELECTION_DEFECTS = ("id_past_end", "id_negative", "id_huge", "unsorted", "duplicate", "count_over",
                     "count_negative", "stray_bit")


def gen_invalid_selections(rng, index, device):
    op = str(rng.choice(("tile_sparse", "bits_sparse", "query_sparse", "token_sparse", "validate", "evaluate")
                        + CONVERSIONS))
    # On the GPU a problem its executors take (bfloat16, head dim 64 or 128), so that the selection
    # is what gets judged rather than q's dtype.
    p = _new_problem(rng) if device != "cuda" else _new_problem(rng, "bfloat16", dims=(64, 128))
    kind = {"bits_sparse": "bits", "query_sparse": "query_lists", "token_sparse": "token_lists",
            "block_bits_to_tile_lists": "bits", "query_lists_to_tile_lists": "query_lists"}.get(op)
    if kind is None:
        kind = str(rng.choice(["tiles", "bits", "query_lists", "token_lists"])) if op in ("validate", "evaluate") \
            else "tiles"
    trusted = bool(rng.integers(2)) and op not in ("validate", "evaluate")
    defects = {"tiles": SELECTION_DEFECTS[:7], "bits": ("stray_bit",),
               "query_lists": ("id_past_end", "id_negative", "id_huge", "duplicate"),
               "token_lists": ("id_past_end", "id_negative", "id_huge", "duplicate")}[kind]
    defect = str(rng.choice(defects))
    if kind == "bits" and p.Tk % 32 == 0:
        p.Lk += 1  # leaves room for a stray bit past Tk
        p.Tk += 1
        p.k, p.v = np.pad(p.k, ((0, 0), (0, 1), (0, 0), (0, 0))), np.pad(p.v, ((0, 0), (0, 1), (0, 0), (0, 0)))
    n_limit = p.Tk if kind != "token_lists" else p.Lk
    if kind == "tiles":
        idx, cnt = tile_lists(rng, p)
        if idx.shape[-1] < 2:
            idx = np.pad(idx, ((0, 0), (0, 0), (0, 0), (0, 1)), constant_values=-1)
        sel = {"idx": idx, "cnt": cnt}
        pos = tuple(int(rng.integers(s)) for s in cnt.shape)
        if defect in ("unsorted", "duplicate"):
            cnt[pos] = 2
            idx[pos][:2] = [min(1, n_limit - 1), 0] if defect == "unsorted" else [0, 0]
            if defect == "unsorted" and n_limit < 2:
                idx[pos][:2] = [0, 0]
        elif defect == "count_over":
            cnt[pos] = idx.shape[-1] + int(rng.integers(1, 1000))
        elif defect == "count_negative":
            cnt[pos] = -int(rng.integers(1, 1000))
        else:
            cnt[pos] = max(cnt[pos], 1)
            idx[pos][cnt[pos] - 1] = {"id_past_end": n_limit, "id_negative": -2, "id_huge": 2**31 - 1}[defect]
    elif kind == "bits":
        bits = block_bits(rng, p)
        pos = tuple(int(rng.integers(s)) for s in bits.shape[:3])
        bits[pos][-1] |= np.uint32(1) << np.uint32(31)
        sel = {"bits": bits}
    else:
        width = int(rng.integers(2, 6))
        idx = query_lists(rng, p, width=width, n=n_limit)
        pos = tuple(int(rng.integers(s)) for s in idx.shape[:3])
        if defect == "duplicate":
            idx[pos][:2] = [0, 0]
        else:
            idx[pos][0] = {"id_past_end": n_limit, "id_negative": -2, "id_huge": 2**31 - 1}[defect]
        sel = {"idx": idx}
    names = ["idx", "cnt", "bits", "tiles", "lists", "tokens", "query_lists", "token_lists"]

    def run():
        import sparse_attn as sa
        a = {n: to_device(x, device) for n, x in sel.items()}
        arg = {"tiles": lambda: (a["idx"], a["cnt"]), "bits": lambda: a["bits"]}.get(kind, lambda: a["idx"])()
        if op == "validate":
            sa.validate(p.shape(), **{kind: arg if kind != "tiles" else tuple(to_host(x) for x in arg)})
        elif op == "evaluate":
            sa.evaluate(p.q, p.k, p.v, causal=p.causal, **{kind: sel.get("bits", sel.get("idx")) if kind != "tiles"
                                                            else (sel["idx"], sel["cnt"])})
        elif op in CONVERSIONS:
            shape = p.shape()
            if op == "tile_lists_to_block_bits":
                sa.tile_lists_to_block_bits(a["idx"], a["cnt"], shape, trusted=trusted)
            elif op == "block_bits_to_tile_lists":
                sa.block_bits_to_tile_lists(a["bits"], shape, trusted=trusted, kmax=p.Tk)
            else:
                sa.query_lists_to_tile_lists(a["idx"], shape, trusted=trusted)
        else:
            q, k, v = (to_device(x, device) for x in (p.q, p.k, p.v))
            sel_args = [a[n] for n in ("idx", "cnt", "bits") if n in a]
            getattr(sa, op)(q, k, v, *sel_args, causal=p.causal, trusted=trusted)
            if device != "cpu" and not trusted:  # tile_sparse reports a faulty list after the kernel
                import torch
                torch.cuda.synchronize()
                sa.check_device_faults()
        if not trusted:
            raise Refused(f"accepted a selection with a defect ({defect})")
    expect = "no_crash" if trusted else "refuse"
    return Case(index, "invalid_selections", {"evaluate": "evaluate_selection"}.get(op, op), expect, names,
                f"{kind} {defect} trusted={trusted}", run)


OPTION_VALUES = {
    "top_k": [0, -1, -2**31, 2**40, 2.5, "4", None, True, 10**6],
    "kmax": [-1, 0, 1, 2.5, "x", 2**40],
    "groups": [0, -1, 2.5, "2", 10**9],
    "precision": ["int4", "", "BF16", 5, None, "fp8 ", "fp16"],
    "representatives": [0, 2, 3, -1, 1.5],
    "format": ["rows", None, 1, "TILE"],
    "alpha": [1.0, 0.5, -1.0, float("nan"), float("inf"), 100.0, "x", None],
    "histogram_bins": [0, 1, -5, 5000, 2.0],
    "merge_window": [-1, 9, 2.5, "x", 10**6],
    "partials": ["f8", "", None, 16],
    "schedule": ["q_centric", "", None],
    "softmax_scale": [0.0, -1.0, float("nan"), float("inf"), "x", 1e30, 1e-30, [1.0]],
}
OPTIONS_OF = {
    "pooled_select": ("top_k", "kmax", "representatives"),
    "token_max_select": ("top_k", "kmax", "precision", "format"),
    "lightning_select": ("top_k", "kmax", "groups", "precision", "format"),
    "entmax": ("alpha", "histogram_bins", "softmax_scale"),
    "query_sparse": ("merge_window", "partials", "schedule", "softmax_scale"),
    "dense": ("softmax_scale",),
    "tile_sparse": ("softmax_scale",),
}
# Values that are valid for the option: a result must then be right rather than refused.
VALID_OPTION = [("top_k", 10**6), ("top_k", True), ("representatives", 2), ("alpha", 100.0),
                ("softmax_scale", 1e30), ("softmax_scale", 1e-30)]


def gen_options(rng, index, device):
    op = str(rng.choice(list(OPTIONS_OF)))
    option = str(rng.choice(OPTIONS_OF[op]))
    values = OPTION_VALUES[option]
    value = values[int(rng.integers(len(values)))]
    p = _new_problem(rng, op=op)
    if op in EXECUTORS:
        arrays, kwargs = _executor_call(rng, op, p, device)
    else:
        arrays, kwargs = selector_inputs(rng, op, p), {"top_k": 2}
    kwargs[option] = value
    valid = any(o == option and type(v) is type(value) and v == value for o, v in VALID_OPTION)

    def run():
        if op in EXECUTORS:
            run_executor(op, p, arrays, kwargs, device)
        else:
            run_selector(op, p, arrays, kwargs, device)
    return Case(index, "options", op, "either" if valid else "refuse", [option],
                f"{option}={value!r}", run)


def _table_file(rng, directory):
    import sparse_attn as sa
    budgets = sorted({int(b) for b in rng.integers(1, 64, size=int(rng.integers(1, 4)))})
    t = sa.ThresholdTable(budgets, int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 3)),
                          model="m")
    t.values = rng.standard_normal(t.values.shape).astype(np.float32)
    path = os.path.join(directory, "table.safetensors")
    t.save(path)
    return path


def _mutate(rng, data: bytes) -> bytes:
    data = bytearray(data)
    n_header = struct.unpack("<Q", bytes(data[:8]))[0]
    kind = str(rng.choice(["flip", "truncate", "length", "json_token", "json_number", "append", "zero_len",
                           "garbage_header"]))
    if kind == "flip":
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(len(data)))
            data[i] ^= 1 << int(rng.integers(8))
    elif kind == "truncate":
        data = data[:int(rng.integers(len(data)))]
    elif kind == "length":
        lengths = [0, 1, n_header - 1, n_header + 1, 2**63, 2**64 - 1, len(data)]
        data[:8] = struct.pack("<Q", lengths[int(rng.integers(len(lengths)))])
    elif kind == "json_token":
        header = bytes(data[8:8 + n_header])
        tokens = [b"F32", b"I64", b"shape", b"data_offsets", b"dtype", b"__metadata__", b"budgets", b"[", b"]",
                  b"{", b"}", b":", b","]
        t = tokens[int(rng.integers(len(tokens)))]
        r = [b"F16", b"U8", b"", b"\"", b"[[", b"{}", b"null", b"-1", b"1e999", b"\\u0000"][int(rng.integers(10))]
        header = header.replace(t, r, 1)
        data = bytearray(struct.pack("<Q", len(header)) + header + bytes(data[8 + n_header:]))
    elif kind == "json_number":
        header = bytes(data[8:8 + n_header])
        digits = [m.start() for m in re.finditer(rb"[0-9]+", header)]
        if digits:
            i = digits[int(rng.integers(len(digits)))]
            repl = [b"-1", b"99999999999999999999", b"0", b"4294967296", b"1.5"][int(rng.integers(5))]
            end = i + len(re.match(rb"[0-9]+", header[i:]).group(0))
            header = header[:i] + repl + header[end:]
        data = bytearray(struct.pack("<Q", len(header)) + header + bytes(data[8 + n_header:]))
    elif kind == "append":
        data += bytes(rng.integers(0, 256, size=int(rng.integers(1, 64)), dtype=np.uint8))
    elif kind == "zero_len":
        data = bytearray()
    else:
        junk = bytes(rng.integers(0, 256, size=n_header, dtype=np.uint8))
        data[8:8 + n_header] = junk
    return bytes(data)


def gen_file_readers(rng, index, device):
    seed = int(rng.integers(2**32))

    def run():
        import sparse_attn as sa
        r = np.random.default_rng(seed)
        with tempfile.TemporaryDirectory() as d:
            path = _table_file(r, d)
            with open(path, "rb") as f:
                original = f.read()
            mutated = _mutate(r, original)
            with open(path, "wb") as f:
                f.write(mutated)
            try:
                t = sa.load_thresholds(path)
            except sa.Error as e:  # the path in a message is that of a temporary file: name it the same
                raise sa.Error(str(e).replace(path, "PATH")) from None
            # Accepted: a well-formed table (values may differ: corrupted data bytes are not detectable).
            values = t.values
            if values.shape != (len(t.budgets), t.n_layers, t.n_heads, t.n_qtiles):
                raise Refused(f"loaded a table whose values {values.shape} disagree with its extents")
            for b in range(len(t.budgets)):
                t.slice(b, t.n_layers - 1)
    return Case(index, "file_readers", "ThresholdTable", "either", ["PATH", "path"], "mutated safetensors", run)


CLI_BASE = {
    "demo": ["demo", "--len", "256", "--device", "cpu"],
    "plan": ["plan", "--lq", "512", "--lk", "512"],
    "bench": ["bench", "dense", "--device", "cpu", "--scale", "64", "--repeat", "1"],
    "eval": ["eval", "--synthetic", "--len", "256"],
}
CLI_OPTIONS = {
    "demo": ["--len", "--batch", "--heads", "--kv-heads", "--budget", "--needles", "--eval-queries", "--seed",
             "--device", "--json"],
    "plan": ["--batch", "--heads", "--kv-heads", "--lq", "--lk", "--dim", "--blocks", "--overlap", "--partials",
             "--merge-window", "--seed"],
    "bench": ["--pattern", "--lk", "--repeat", "--sustain-ms", "--scale", "--density", "--partials",
              "--verify-rows", "--seed", "--device"],
    "eval": ["--selector", "--budget", "--eval-queries", "--softmax-scale", "--seed", "--len", "--batch", "--heads",
             "--kv-heads", "--needles", "--input"],
}
CLI_VALUES = ["-1", "0", "nan", "inf", "-inf", "1e400", "abc", "", "99999999999999999999", "2.5", "0x10",
              "/nonexistent/file", "-", "--", "1,2,", "\u00e9"]


def gen_cli(rng, index, device, cli=None):
    sub = str(rng.choice(list(CLI_BASE)))
    option = str(rng.choice(CLI_OPTIONS[sub] + ["--no-such-option"]))
    value = str(rng.choice(CLI_VALUES))
    argv = list(CLI_BASE[sub])
    if option in argv:
        i = argv.index(option)
        del argv[i:i + 2]
    argv += [option, value] if rng.integers(8) else [option]
    return Case(index, "cli", f"sparse-attn {sub}", "cli", [option, value], " ".join(argv), argv)


GENERATORS = {"shapes": gen_shapes, "dtypes": gen_dtypes, "strides": gen_strides, "aliasing": gen_aliasing,
              "non_finite": gen_non_finite, "invalid_selections": gen_invalid_selections, "options": gen_options,
              "file_readers": gen_file_readers, "cli": gen_cli}


def make_case(seed, index, device, categories):
    rng = np.random.default_rng([seed, index])
    category = categories[index % len(categories)]
    return GENERATORS[category](rng, index, device)


# ---- the child process ----------------------------------------------------------------------------

def child(seed, index, device, categories):
    case = make_case(seed, index, device, categories)
    try:
        case.run()
        result = {"outcome": "returned"}
    except Refused as e:
        result = {"outcome": "wrong", "message": str(e)}
    except Exception as e:  # the outcome being classified: any exception type is a result
        result = {"outcome": "error", "type": type(e).__name__, "message": str(e)[:2000]}
    sys.stdout.flush()
    print("\n@@RESULT " + json.dumps(result), flush=True)


# ---- classification --------------------------------------------------------------------------------

_ARGUMENT = re.compile(r"argument '([^']*)'")


def names_argument(message, names):
    found = _ARGUMENT.findall(message)
    return any(any(n and (f == n or f.endswith("." + n) or f.startswith(n + ".") or n in f.split("."))
                   for n in names) for f in found) or any(n in message for n in names if n.startswith("PATH"))


def classify(case, rc, stdout, stderr, timed_out):
    if timed_out:
        return "hang", f"no result within the timeout"
    if case.category == "cli":
        text = (stdout + stderr).strip()
        if rc < 0:
            return "crash", f"signal {-rc}"
        if rc == 0:
            return "correct", "accepted (exit 0)"
        option, value = case.names
        if option in text or (value and value in text and "--" in text):
            return "clear_error", text[-300:]
        return "vague_error", text[-300:]
    marker = stdout.rfind("@@RESULT ")
    if rc < 0 or marker < 0:
        return "crash", f"exit {rc}: {stderr.strip()[-500:]}"
    result = json.loads(stdout[marker + len("@@RESULT "):].strip().splitlines()[0])
    if result["outcome"] == "error":
        message = f"{result['type']}: {result['message']}"
        if message.startswith("Refused"):
            return "silently_wrong", message
        op_named = result["message"].startswith(case.op + ":") or case.op in result["message"].split(":")[0]
        if op_named and names_argument(result["message"], case.names):
            return "clear_error", message
        return "vague_error", message
    if case.expect == "no_crash":
        return "correct", result.get("message", "returned")
    if result["outcome"] == "wrong":
        if result["message"].startswith("skipped"):
            return "correct", result["message"]
        return "silently_wrong", result["message"]
    if case.expect == "refuse":
        return "silently_wrong", "accepted input that must be refused"
    return "correct", "matches the reference"


def run_case(script, seed, index, device, categories, timeout, cli):
    case = make_case(seed, index, device, categories)
    if case.category == "cli":
        if cli is None:
            return None
        cmd = [cli] + case.run
    else:
        cmd = [sys.executable, script, "--child", str(index), "--seed", str(seed), "--device", device,
               "--categories", ",".join(categories)]
    start = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        with tempfile.TemporaryDirectory() as cwd:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd,
                                  errors="replace", start_new_session=True)
        rc, out, err, timed_out = proc.returncode, proc.stdout, proc.stderr, False
    except subprocess.TimeoutExpired as e:
        rc, timed_out = None, True
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = ""
    outcome, detail = classify(case, rc if rc is not None else 0, out, err, timed_out)
    return {"index": index, "category": case.category, "op": case.op, "expect": case.expect, "what": case.what,
            "outcome": outcome, "detail": detail, "seconds": round(time.time() - start, 2)}


OUTCOMES = ("crash", "hang", "clear_error", "vague_error", "correct", "silently_wrong")


def campaign(cases, seed=0, jobs=None, timeout=60.0, device="cpu", categories=CATEGORIES, cli=None,
             progress=False):
    """Runs cases 0 .. cases-1; returns the list of per-case records."""
    script = os.path.abspath(__file__)
    cli = os.path.abspath(cli) if cli else None
    categories = [c for c in categories if c != "cli" or cli is not None]
    jobs = jobs or os.cpu_count() or 1
    records = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(run_case, script, seed, i, device, categories, timeout, cli) for i in range(cases)]
        for n, f in enumerate(concurrent.futures.as_completed(futures)):
            r = f.result()
            if r is not None:
                records.append(r)
            if progress and (n + 1) % 100 == 0:
                print(f"  {n + 1}/{cases}", file=sys.stderr, flush=True)
    return sorted(records, key=lambda r: r["index"])


def summary(records):
    counts = collections.defaultdict(collections.Counter)
    for r in records:
        counts[r["category"]][r["outcome"]] += 1
        counts["all"][r["outcome"]] += 1
    return {c: dict(v) for c, v in counts.items()}


def report(records):
    counts = summary(records)
    width = max(len(c) for c in counts)
    print(f"{'category':<{width}} " + " ".join(f"{o:>14}" for o in OUTCOMES))
    for c in [c for c in CATEGORIES if c in counts] + ["all"]:
        print(f"{c:<{width}} " + " ".join(f"{counts[c].get(o, 0):>14}" for o in OUTCOMES))
    for outcome in ("crash", "hang", "silently_wrong", "vague_error"):
        listed = [r for r in records if r["outcome"] == outcome]
        if listed:
            print(f"\n{outcome} ({len(listed)}):")
            for r in listed:
                print(f"  #{r['index']} {r['category']} {r['op']} [{r['what']}]: {r['detail']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--cli", help="path of the built sparse-attn binary (the cli category runs only with it)")
    ap.add_argument("--json", help="write every case's record and the counts to this file")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--only", type=int, help="run case INDEX in this process and print its result")
    args = ap.parse_args(argv)
    categories = [c for c in args.categories.split(",") if c]
    if args.child is not None:
        child(args.seed, args.child, args.device, categories)
        return 0
    if args.only is not None:
        cats = [c for c in categories if c != "cli" or args.cli]
        case = make_case(args.seed, args.only, args.device, cats)
        print(f"#{case.index} {case.category} {case.op} expect={case.expect}: {case.what}")
        if case.category != "cli":
            child(args.seed, args.only, args.device, cats)
        return 0
    start = time.time()
    records = campaign(args.cases, args.seed, args.jobs, args.timeout, args.device, categories, args.cli,
                       progress=True)
    report(records)
    print(f"\n{len(records)} cases in {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "device": args.device, "counts": summary(records), "cases": records}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
