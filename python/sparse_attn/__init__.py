"""sparse_attn: input-dependent sparse attention for long-context prefill.

Conventions follow flash-attn: ``q`` is ``(B, Lq, Hq, D)``, ``k`` and ``v`` are ``(B, Lk, Hkv, D)``
with ``Hq % Hkv == 0`` (GQA is native: K and V are never repeated), the last dimension must be
contiguous and every other stride is free. ``causal=True`` is aligned to the bottom right (query
``i`` sees key ``j`` iff ``j <= i + Lk - Lq``), so chunked prefill with ``Lq < Lk`` works. Every
function of this package that takes ``causal`` (executors, selectors, ``problem_shape``,
``evaluate``) defaults to ``causal=False``, as flash-attn and the C++ ``AttentionOptions`` do: pass
``causal=True`` for causal prefill, to the selector as well as to the executor.
``return_lse=True`` also returns ``lse``, float32 ``(B, Hq, Lq)``: the NATURAL log of the softmax
denominator, scale included (not base 2, unlike FlashInfer's MLA kernels). A query that sees no key
gets ``out = 0`` and ``lse = -inf``.

Arrays may be numpy arrays (CPU; float32, float16, or ml_dtypes.bfloat16) or torch tensors (CPU or
CUDA); outputs are allocated with the same library and on the same device as ``q``, or written into
``out=``. For CUDA tensors the operators run on the current torch stream. Bad input raises
:class:`Error` (a ``ValueError``) whose message names the operator, the argument and the offending
value or coordinate; an argument of the wrong type (a str softmax_scale, a float top_k, a tuple for
a ProblemShape) raises ``TypeError`` naming the same.

Selections (int32 index tensors, on q's device):

* TileLists ``(idx [B, G, Tq, Kmax], cnt [B, G, Tq])``: per 128-query tile, ``cnt`` ascending
  128-key block ids; ``G = Hkv`` (shared by the group) or ``G = Hq``.
* BlockBits ``bits uint32 [B, G, Tq, ceil(Tk / 32)]``.
* QueryLists ``idx [B, Hkv, Lq, Kq]``: per query, block ids, ``-1`` = empty slot.
* TokenLists ``idx [B, Hkv, Lq, Kt]``: per query, key positions, ``-1`` = empty slot.

Importing this package does not import torch; :mod:`sparse_attn.torch` holds the torch.library
custom ops and the Hugging Face attention registration. Its functions take the same arguments and
return the same results as the functions of the same name here.
:mod:`sparse_attn.distributed` (torch too) shards one sequence across the ranks of a
torch.distributed group (context-parallel dense, tile_sparse and query_sparse).
"""

from __future__ import annotations

import functools as _functools
import operator as _operator
import sys as _sys

import numpy as _np

from . import _ext
from ._ext import (
    BLOCK_K,
    GATE_ROWS,
    TILE_Q,
    Calibrator,
    Error,
    ProblemShape,
    ThresholdTable,
    build_info,
    check_device_faults,
    cuda_available,
    cuda_devices,
    e2m1_to_float,
    e4m3_to_float,
    float_to_e2m1,
    float_to_e4m3,
    precision_name,
    quantize_dequantize,
)

__version__ = _ext.build_info()["version"]

__all__ = [
    "BLOCK_K", "GATE_ROWS", "TILE_Q", "Calibrator", "Error", "ProblemShape", "ThresholdTable",
    "bits_sparse", "block_bits_to_tile_lists", "build_info", "calibrate_thresholds", "check_device_faults", "cuda_available", "cuda_devices",
    "dense", "e2m1_to_float", "e4m3_to_float", "entmax", "evaluate", "expand_mask", "float_to_e2m1",
    "float_to_e4m3", "gated", "lightning_select", "lightning_workspace_bytes", "load_thresholds", "Plan", "plan",
    "plan_schedule", "pooled_select", "pooled_workspace_bytes", "precision_name", "problem_shape", "quantize_dequantize", "query_lists_to_tile_lists",
    "query_sparse", "run", "sparse_attention", "tile_lists_to_block_bits", "tile_sparse",
    "token_max_select", "token_max_workspace_bytes", "token_sparse", "validate", "workspace_bytes",
]


# ---- arguments -----------------------------------------------------------------------------------
# Every call into the extension goes through _native, whose functions turn nanobind's "incompatible
# function arguments" (the whole signature, no argument named) into a TypeError that names the
# operator, the argument, what it takes and what was given. Scalars are passed to the extension as
# they were given, so that its typed parameters refuse a float top_k or a str softmax_scale instead of
# a Python conversion truncating or misreading them.

def _split(text, sep):
    """text split at `sep` outside brackets and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for i, c in enumerate(text):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def _signature_parameters(text):
    params = text[text.index("(") + 1:text.rindex(")")]
    result = []
    for p in _split(params, ","):
        name, _, annotation = p.partition(":")
        if name.strip():
            result.append((name.strip(), _split(annotation, "=")[0] or "object"))
    return result


def _parameters(fn, args=(), kwargs=None):
    """[(name, annotation)] of an extension function; of an overloaded one (ThresholdTable's
    constructors), the one overload that can take as many arguments as were given, with their names."""
    candidates = [_signature_parameters(s[0]) for s in getattr(fn, "__nb_signature__", ())]
    if len(candidates) > 1:
        candidates = [c for c in candidates
                      if len(c) >= len(args) + len(kwargs or {}) and set(kwargs or {}) <= {n for n, _ in c}]
    return candidates[0] if len(candidates) == 1 else None


def _fits(value, annotation):
    """Whether nanobind converts `value` for `annotation`; None when this cannot tell."""
    unknown = False
    for a in _split(annotation, "|"):
        if a == "None" or a == "object":
            ok = (value is None) == (a == "None")
        elif a == "int":
            ok = hasattr(type(value), "__index__")
        elif a == "float":
            ok = not isinstance(value, (str, bytes)) and hasattr(type(value), "__float__")
        elif a == "bool":
            ok = isinstance(value, bool)
        elif a == "str":
            ok = isinstance(value, str)
        elif "[" not in a and "." in a:
            ok = type(value).__name__ == a.rpartition(".")[2]
        elif a.startswith("collections.abc.Sequence["):
            ok = isinstance(value, (list, tuple)) or None  # the elements are not looked at
        elif a.startswith("ndarray["):
            ok = None if hasattr(value, "__array_interface__") or hasattr(value, "__dlpack__") else False
        else:
            unknown = True
            continue
        if ok:
            return True
        unknown = unknown or ok is None
    return None if unknown else False


def _given(value):
    """What was given, for a message: the type, and the value where it is short."""
    t = type(value)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"{name} of dtype {value.dtype} and shape {list(value.shape)}"
    text = repr(value)
    return f"{name} {text}" if len(text) <= 40 else name


def _type_error(fn, op, args, kwargs):
    """The TypeError naming the first argument of a call that does not fit fn's signature, or None."""
    params = _parameters(fn, args, kwargs)
    if params is None:
        return None
    given = dict(zip((name for name, _ in params), args))
    given.update(kwargs)
    op = given.get("op") if isinstance(given.get("op"), str) else op
    fits = {name: _fits(given[name], annotation) for name, annotation in params if name in given}
    # The first argument that does not fit; else the only one whose fit this cannot tell (an ndarray
    # of the wrong dtype, say).
    culprits = [n for n, f in fits.items() if f is False] or [n for n, f in fits.items() if f is None]
    if len(culprits) != 1 and not any(f is False for f in fits.values()):
        return None
    name = culprits[0]
    annotation = dict(params)[name].replace("sparse_attn._ext.", "sparse_attn.")
    expected = "an array" if annotation == "object" else annotation
    return TypeError(f"{op}: argument '{name}': expected {expected}, got {_given(given[name])}")


def _named_type_errors(fn, op):
    """fn, raising for an argument nanobind cannot convert a TypeError that names it (see above)."""
    @_functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TypeError as e:
            if "incompatible function arguments" not in str(e):
                raise
            error = _type_error(fn, op, args, kwargs)
            if error is None:
                raise
        raise error
    del call.__wrapped__  # inspect.signature cannot read an extension function
    return call


class _Native:
    """The extension's functions, each through _named_type_errors (made on first use)."""

    def __getattr__(self, name):
        fn = _named_type_errors(getattr(_ext, name), name)
        setattr(self, name, fn)
        return fn


_native = _Native()

for _name in ("check_device_faults", "e2m1_to_float", "e4m3_to_float", "float_to_e2m1", "float_to_e4m3",
              "precision_name", "quantize_dequantize"):
    globals()[_name] = getattr(_native, _name)

def _constructor_type_error(op, args, kwargs):
    """Raises the TypeError for arguments that fit none of class `op`'s constructors (the extension's
    last overload calls this): the first argument that does not fit the overload taking as many."""
    init = getattr(_ext, op).__init__
    signatures = [s for s in getattr(init, "__nb_signature__", ()) if "*" not in s[0]]

    class _Init:  # the overloads the caller could have meant, for _type_error
        __nb_signature__ = tuple(signatures)
    error = _type_error(_Init, op, (_Init,) + tuple(args), dict(kwargs))
    if error is None:
        given = ", ".join([_given(a) for a in args] + [f"{k}={_given(v)}" for k, v in kwargs.items()])
        forms = "; ".join(s[0].replace("def __init__(self, ", f"{op}(").replace("def __init__(self", f"{op}(")
                          .replace(" -> None", "").replace("sparse_attn._ext.", "sparse_attn.") for s in signatures)
        error = TypeError(f"{op}: arguments ({given}) match no constructor: {forms}")
    raise error


# The classes' methods name the argument too, with the class as the operator (as their own errors
# do: "ThresholdTable: argument 'budget': ..."); their constructors do it through the extension's last
# overload (_constructor_type_error above).
for _cls in (ProblemShape, ThresholdTable, Calibrator):
    for _name in [n for n in vars(_cls) if not n.startswith("_")]:
        _fn = vars(_cls)[_name]
        if type(_fn).__name__ == "nb_method":
            setattr(_cls, _name, _named_type_errors(_fn, _cls.__name__))
        elif type(_fn).__name__ == "nb_func":  # a static method (ThresholdTable.load)
            setattr(_cls, _name, staticmethod(_named_type_errors(_fn, _cls.__name__)))
del _name, _cls, _fn


def _int(op, name, value, minimum=None):
    """value as an int (>= minimum): TypeError for a non-integer (no truncation of 2.5), Error below."""
    if not hasattr(type(value), "__index__"):
        raise TypeError(f"{op}: argument '{name}': expected int, got {_given(value)}")
    value = _operator.index(value)
    if minimum is not None and value < minimum:
        raise Error(f"{op}: argument '{name}': must be >= {minimum}, got {value}")
    return value


_INT32_MAX = 2**31 - 1


def _kmax(op, top_k, kmax):
    """A selector's list capacity, checked before it is allocated: kmax, or top_k when kmax is None;
    at least top_k and within int32."""
    top_k = _int(op, "top_k", top_k, 1)
    if top_k > _INT32_MAX:
        raise Error(f"{op}: argument 'top_k': must be <= {_INT32_MAX}, got {top_k}")
    if kmax is None:
        return top_k
    kmax = _int(op, "kmax", kmax)
    if kmax < top_k:
        raise Error(f"{op}: argument 'kmax': {kmax} is smaller than top_k = {top_k}")
    if kmax > _INT32_MAX:
        raise Error(f"{op}: argument 'kmax': must be <= {_INT32_MAX}, got {kmax}")
    return kmax


def _problem(op, shape):
    if not isinstance(shape, ProblemShape):
        raise TypeError(f"{op}: argument 'shape': expected sparse_attn.ProblemShape, got {_given(shape)}")
    return shape


# ---- array plumbing ---------------------------------------------------------------------------

def _is_torch(x) -> bool:
    return type(x).__module__.partition(".")[0] == "torch"


def _torch():
    # Only reached for torch tensors, so torch is already imported by the caller.
    return _sys.modules["torch"]


def _dl(x):
    """What the extension gets for an array: numpy arrays and CPU tensors as they are, CUDA tensors
    as a DLPack capsule exported with stream=-1 (no producer-side synchronisation: the operator
    itself runs on the current stream, which is the stream the tensors are ordered on)."""
    if x is None or not _is_torch(x):
        return x
    x = x.detach()
    if x.device.type == "cuda":
        return x.__dlpack__(stream=-1)
    return x


def _stream(q) -> int:
    if _is_torch(q) and q.device.type == "cuda":
        return _torch().cuda.current_stream(q.device).cuda_stream
    return 0


def _empty(like, shape, dtype=None):
    """Uninitialised array of the same library and device as `like`. dtype: a numpy-style name
    ("float32", "int32", "uint32") or None for like's dtype."""
    shape = tuple(int(s) for s in shape)
    if _is_torch(like):
        torch = _torch()
        dt = like.dtype if dtype is None else getattr(torch, dtype)
        return torch.empty(shape, dtype=dt, device=like.device)
    if not hasattr(like, "dtype"):
        raise Error(f"expected a numpy array or torch tensor, got {type(like).__module__}.{type(like).__qualname__}")
    return _np.empty(shape, dtype=like.dtype if dtype is None else dtype)


def _full(like, shape, value, dtype):
    a = _empty(like, shape, dtype)
    if _is_torch(a):
        a.fill_(value)
    else:
        a.fill(value)
    return a


def _shape(x, op, name, ndim):
    shape = getattr(x, "shape", None)
    if shape is None:
        raise Error(f"{op}: argument '{name}': expected an array (numpy.ndarray or torch.Tensor), "
                    f"got {type(x).__module__}.{type(x).__qualname__}")
    if len(shape) != ndim:
        raise Error(f"{op}: argument '{name}': expected {ndim} dimensions, got shape {list(shape)}")
    return tuple(int(s) for s in shape)


def _ceil_div(a, b):
    return (a + b - 1) // b


def _outputs(op, q, out, return_lse):
    _shape(q, op, "q", 4)
    if out is None:
        out = _empty(q, q.shape)
    lse = None
    if return_lse:
        B, Lq, Hq, _ = q.shape
        lse = _empty(q, (B, Hq, Lq), "float32")
    return out, lse


def _result(out, lse, return_lse):
    return (out, lse) if return_lse else out


def _pair(out, op):
    """The (idx, cnt) pair of an out= argument that receives TileLists."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise Error(f"{op}: argument 'out': expected a pair (idx, cnt)")
    return out[0], out[1]


# ---- executors --------------------------------------------------------------------------------

def dense(q, k, v, *, softmax_scale=None, causal=False, return_lse=False, out=None):
    """Dense attention over every visible key. Returns out, or (out, lse) with return_lse."""
    out, lse = _outputs("dense", q, out, return_lse)
    _native.dense(_dl(q), _dl(k), _dl(v), _dl(out), _dl(lse), softmax_scale=softmax_scale,
                  causal=bool(causal), stream=_stream(q))
    return _result(out, lse, return_lse)


def tile_sparse(q, k, v, idx, cnt, *, softmax_scale=None, causal=False, return_lse=False, out=None,
                trusted=False):
    """Q-centric block-sparse attention over TileLists (idx [B, G, Tq, Kmax], cnt [B, G, Tq]).
    trusted=True skips validation of the lists (the caller produced them)."""
    out, lse = _outputs("tile_sparse", q, out, return_lse)
    _native.tile_sparse(_dl(q), _dl(k), _dl(v), _dl(idx), _dl(cnt), _dl(out), _dl(lse),
                        softmax_scale=softmax_scale, causal=bool(causal), trusted=bool(trusted),
                        stream=_stream(q))
    return _result(out, lse, return_lse)


def bits_sparse(q, k, v, bits, *, softmax_scale=None, causal=False, return_lse=False, out=None,
                trusted=False):
    """Block-sparse attention over BlockBits (uint32 [B, G, Tq, ceil(Tk / 32)])."""
    out, lse = _outputs("bits_sparse", q, out, return_lse)
    _native.bits_sparse(_dl(q), _dl(k), _dl(v), _dl(bits), _dl(out), _dl(lse),
                        softmax_scale=softmax_scale, causal=bool(causal), trusted=bool(trusted),
                        stream=_stream(q))
    return _result(out, lse, return_lse)


def query_sparse(q, k, v, idx, *, partials="f32", softmax_scale=None, causal=False, return_lse=False,
                 out=None, trusted=False, schedule="kv_centric", merge_window=0):
    """Attention over QueryLists (idx [B, Hkv, Lq, Kq], -1 = empty slot). schedule: "kv_centric"
    (reverse index, partial outputs, combine) or "group_centric" (one query's heads of a group as
    the rows of an MMA tile; suits large GQA groups); the CPU runs its reference for either.
    partials: storage of the KV-centric per-slot partial outputs, "f32" or "bf16".
    merge_window: KV-centric on the GPU, a query's blocks within one window of this many blocks leave
    one partial (0: chosen from the lists' shape, 1: off, 2 to 8); the result is the same attention."""
    out, lse = _outputs("query_sparse", q, out, return_lse)
    _native.query_sparse(_dl(q), _dl(k), _dl(v), _dl(idx), _dl(out), _dl(lse),
                         softmax_scale=softmax_scale, causal=bool(causal), trusted=bool(trusted),
                         partials=partials, schedule=schedule, merge_window=merge_window,
                         stream=_stream(q))
    return _result(out, lse, return_lse)


def token_sparse(q, k, v, idx, *, softmax_scale=None, causal=False, return_lse=False, out=None,
                 trusted=False):
    """Attention over TokenLists (idx [B, Hkv, Lq, Kt] key positions, -1 = empty slot), shared by
    the query heads of each group."""
    out, lse = _outputs("token_sparse", q, out, return_lse)
    _native.token_sparse(_dl(q), _dl(k), _dl(v), _dl(idx), _dl(out), _dl(lse),
                         softmax_scale=softmax_scale, causal=bool(causal), trusted=bool(trusted),
                         stream=_stream(q))
    return _result(out, lse, return_lse)


def _selection(op, tiles, bits, query_lists, token_lists):
    given = [(n, s) for n, s in (("tiles", tiles), ("bits", bits), ("query_lists", query_lists),
                                 ("token_lists", token_lists)) if s is not None]
    if len(given) > 1:
        raise Error(f"{op}: argument 'selection': give at most one of tiles, bits, query_lists, "
                    f"token_lists; got {', '.join(n for n, _ in given)}")
    if not given:
        return "dense", None, None
    kind, sel = given[0]
    if kind == "tiles":
        if not isinstance(sel, (tuple, list)) or len(sel) != 2:
            raise Error(f"{op}: argument 'tiles': expected a pair (idx, cnt)")
        return kind, _dl(sel[0]), _dl(sel[1])
    return kind, _dl(sel), None


# ---- plan / run ----------------------------------------------------------------------------------

def workspace_bytes(shape: ProblemShape, Kq, *, partials="f32") -> int:
    """Bytes of device workspace that plan() needs for QueryLists of Kq slots per query (0 in a
    build without the CUDA backend; CPU problems need none whatever this returns)."""
    return _native.query_sparse_workspace_bytes(_problem("workspace_bytes", shape), Kq, partials)


class Plan:
    """A KV-centric query_sparse plan (see plan()). It keeps the lists and the workspace it was built
    in alive; both must stay unchanged while the plan is used. Attributes: shape (ProblemShape),
    lists, workspace, partials, merge_window (resolved), softmax_scale, causal."""

    def __init__(self, native, lists, workspace, partials, merge_window, softmax_scale, causal):
        self.native, self.lists, self.workspace = native, lists, workspace
        self.partials, self.merge_window = partials, merge_window
        self.softmax_scale, self.causal = softmax_scale, causal
        self.shape = native.shape

    def __repr__(self):
        return (f"sparse_attn.Plan({self.shape}, Kq={self.native.Kq}, partials={self.partials!r}, "
                f"merge_window={self.native.merge_window})")


def plan(q, k, v, query_lists, *, workspace=None, partials="f32", softmax_scale=None, causal=False,
         trusted=False, merge_window=0) -> Plan:
    """Plans KV-centric query_sparse over QueryLists (idx [B, Hkv, Lq, Kq]): validates the lists
    (unless trusted: validation reads its verdict back, one synchronisation) and builds the reverse
    index in `workspace` (uint8 [>= workspace_bytes(...)] on q's device, owned by the caller; None
    allocates one). q, k and v give the shapes, dtype and device; their values are not read.

    run(plan, q, k, v, out=...) then runs attention and combine on the current stream without
    allocating or synchronising, as often as needed with new q, k, v of the same shapes: a CUDA
    graph can capture it. Make the plan on the stream that runs it (or order the streams)."""
    shape = problem_shape(q, k, causal=causal)
    Kq = _shape(query_lists, "plan", "query_lists", 4)[3]
    if workspace is None:
        on_cpu = not _is_torch(q) or q.device.type == "cpu"
        workspace = _empty(q, (0 if on_cpu else workspace_bytes(shape, Kq, partials=partials),), "uint8")
    native = _native.query_sparse_plan(_dl(q), _dl(k), _dl(v), _dl(query_lists), _dl(workspace),
                                       softmax_scale=softmax_scale, causal=bool(causal), trusted=bool(trusted),
                                       partials=partials, merge_window=merge_window, stream=_stream(q))
    return Plan(native, query_lists, workspace, partials, merge_window, softmax_scale, bool(causal))


def run(plan: Plan, q, k, v, *, out=None, lse=None, return_lse=False):
    """Attention of a Plan over q, k, v of its shapes, on the current stream. out= (and lse=, float32
    [B, Hq, Lq]) write into caller tensors: with both given nothing is allocated. Returns out, or
    (out, lse) with return_lse or lse=."""
    if not isinstance(plan, Plan):
        raise TypeError(f"run: argument 'plan': expected sparse_attn.Plan, got {_given(plan)}")
    if out is None or (return_lse and lse is None):
        new_out, new_lse = _outputs("run", q, out, return_lse and lse is None)
        out, lse = new_out, lse if lse is not None else new_lse
    _native.query_sparse_run(plan.native, _dl(q), _dl(k), _dl(v), _dl(out), _dl(lse),
                             softmax_scale=plan.softmax_scale, causal=plan.causal, partials=plan.partials,
                             merge_window=plan.merge_window, stream=_stream(q))
    return (out, lse) if (return_lse or lse is not None) else out


def sparse_attention(q, k, v, *, tiles=None, bits=None, query_lists=None, token_lists=None,
                     softmax_scale=None, causal=False, return_lse=False, out=None, trusted=False):
    """Attention over whichever selection is given (none: dense). tiles is a pair (idx, cnt)."""
    kind, a, b = _selection("sparse_attention", tiles, bits, query_lists, token_lists)
    out, lse = _outputs("sparse_attention", q, out, return_lse)
    _native.sparse_attention(_dl(q), _dl(k), _dl(v), _dl(out), kind, a, b, lse=_dl(lse),
                             softmax_scale=softmax_scale, causal=bool(causal),
                             trusted=bool(trusted), stream=_stream(q))
    return _result(out, lse, return_lse)


# The counters of gated's statistics, in the order torch.ops.sparse_attn.gated returns them.
_GATED_COUNTS = ("kept_blocks", "visible_blocks", "gated_candidates", "gated_kept")


def _gated_stats(counts, kept_per_tile):
    """gated's stats dict from its four counters (and kept_per_tile when asked for)."""
    stats = dict(zip(_GATED_COUNTS, (int(c) for c in counts)))
    visible = stats["visible_blocks"]
    stats["density"] = stats["kept_blocks"] / visible if visible else 0.0
    if kept_per_tile is not None:
        stats["kept_per_tile"] = kept_per_tile
    return stats


def gated(q, k, v, thresholds, *, softmax_scale=None, return_lse=False, out=None,
          return_kept_per_tile=False, sink_blocks=1):
    """Causal BSFA-gated attention, gated per GATE_ROWS queries (a gate tile). thresholds: float32
    [Hq, T] (one budget and layer of a ThresholdTable, e.g. ``table.slice(budget, layer)``); gate
    tiles past T use the last column. The first sink_blocks KV blocks are always kept, like the
    diagonal: pass the table's ``sink_blocks``.

    Returns (out, stats) or, with return_lse, (out, lse, stats), as ``sparse_attn.torch.gated``
    does. stats is a dict of Python numbers: kept_blocks (visits that ran PV), visible_blocks,
    gated_candidates (visible visits off the diagonal and past the sinks), gated_kept, density
    (kept / visible) and, with return_kept_per_tile, "kept_per_tile" (int32 [B, Hq, ceil(Lq /
    GATE_ROWS)] array of q's library: blocks kept per gate tile, diagonal and sinks included)."""
    out, lse = _outputs("gated", q, out, return_lse)
    kept = None
    if return_kept_per_tile:
        B, Lq, Hq, _ = q.shape
        kept = _empty(q, (B, Hq, _ceil_div(Lq, GATE_ROWS)), "int32")
    if _is_torch(q) and isinstance(thresholds, _np.ndarray):
        thresholds = _torch().as_tensor(_np.ascontiguousarray(thresholds, dtype=_np.float32), device=q.device)
    counts = _native.gated(_dl(q), _dl(k), _dl(v), _dl(thresholds), _dl(out), _dl(lse),
                           softmax_scale=softmax_scale, kept_per_tile=_dl(kept), stream=_stream(q),
                           sink_blocks=_int("gated", "sink_blocks", sink_blocks))
    stats = _gated_stats((counts[name] for name in _GATED_COUNTS), kept)
    return (out, lse, stats) if return_lse else (out, stats)


def entmax(q, k, v, *, alpha=1.5, softmax_scale=None, causal=False, histogram_bins=64,
           return_block_bits=False, return_stats=False, out=None):
    """alpha-entmax attention (alpha > 1; 2 is sparsemax): p = [(alpha - 1) z - tau]_+^(1 / (alpha - 1))
    with z = softmax_scale * q.k, out = p v. Returns out, then block_bits (uint32
    [B, Hq, Tq, ceil(Tk / 32)]: tiles with any nonzero weight) with return_block_bits, then a stats
    dict (active_tiles, visible_tiles, support) with return_stats."""
    _shape(q, "entmax", "q", 4)
    if out is None:
        out = _empty(q, q.shape)
    bits = None
    if return_block_bits:
        B, Lq, Hq, _ = q.shape
        Lk = _shape(k, "entmax", "k", 4)[1]
        bits = _empty(q, (B, Hq, _ceil_div(Lq, TILE_Q), _ceil_div(_ceil_div(Lk, BLOCK_K), 32)), "uint32")
    stats = _native.entmax(_dl(q), _dl(k), _dl(v), _dl(out), alpha=alpha,
                           softmax_scale=softmax_scale, causal=bool(causal),
                           histogram_bins=histogram_bins, block_bits=_dl(bits), stream=_stream(q))
    result = (out,)
    if return_block_bits:
        result += (bits,)
    if return_stats:
        result += (stats,)
    return result[0] if len(result) == 1 else result


# ---- selectors --------------------------------------------------------------------------------

def _tile_lists_out(ref, op, B, Hkv, Lq, top_k, kmax, out):
    """TileLists for a selector to write: the caller's pair `out`, or new idx [B, Hkv, Tq, kmax]
    filled with -1 and cnt [B, Hkv, Tq] on ref's device."""
    if out is not None:
        return _pair(out, op)
    Tq = _ceil_div(Lq, TILE_Q)
    return (_full(ref, (B, Hkv, Tq, _kmax(op, top_k, kmax)), -1, "int32"), _empty(ref, (B, Hkv, Tq), "int32"))


def pooled_select(q, k, *, top_k=16, representatives=1, force_local=True, force_block0=False,
                  causal=False, kmax=None, out=None, workspace=None):
    """R1 / R4 pooled selector. Returns TileLists (idx int32 [B, Hkv, Tq, kmax], cnt int32
    [B, Hkv, Tq]); kmax defaults to top_k. Slots past cnt hold -1. out=(idx, cnt) writes into
    those tensors instead (kmax is then idx's last extent). workspace: uint8 device scratch of at
    least pooled_workspace_bytes(...) (default: the library's own per device and stream)."""
    B, Lq, _, _ = _shape(q, "pooled_select", "q", 4)
    Hkv = _shape(k, "pooled_select", "k", 4)[2]
    idx, cnt = _tile_lists_out(q, "pooled_select", B, Hkv, Lq, top_k, kmax, out)
    _native.pooled_select(_dl(q), _dl(k), _dl(idx), _dl(cnt), representatives=representatives,
                          top_k=top_k, force_local=bool(force_local), force_block0=bool(force_block0),
                          causal=bool(causal), workspace=_dl(workspace), stream=_stream(q))
    return idx, cnt


def pooled_workspace_bytes(q, k, *, representatives=1) -> int:
    """Bytes of device scratch a CUDA pooled_select of q, k with `representatives` takes (0 on the
    CPU): the size of a caller's workspace=."""
    return _native.pooled_workspace_bytes(_dl(q), _dl(k), representatives=representatives)


def token_max_select(qidx, kidx, *, top_k=16, precision="bf16", causal=False, reserve_local=True,
                     force_block0=False, format="query", kmax=None, out=None, workspace=None):
    """MSA token-max selector on index vectors qidx [B, Lq, Hkv, Di], kidx [B, Lk, 1 or Hkv, Di].
    format="query": QueryLists idx [B, Hkv, Lq, kmax] (ascending, -1 padded);
    format="tile": TileLists (idx [B, Hkv, Tq, kmax], cnt [B, Hkv, Tq]).
    precision: "bf16", "fp8_e4m3" or "fp4_e2m1". force_block0 keeps block 0 (attention sink) in every
    list that sees a key, like the reserved local block. out= writes into caller tensors instead: idx for
    format="query", the pair (idx, cnt) for format="tile". workspace: uint8 device scratch of at least
    token_max_workspace_bytes(...) (default: the library's own per device and stream)."""
    B, Lq, Hkv, _ = _shape(qidx, "token_max_select", "qidx", 4)
    if format == "query":
        idx = out if out is not None else _full(qidx, (B, Hkv, Lq, _kmax("token_max_select", top_k, kmax)), -1,
                                                "int32")
        _native.token_max_select(_dl(qidx), _dl(kidx), _dl(idx), None, top_k=top_k,
                                 precision=precision, causal=bool(causal),
                                 reserve_local=bool(reserve_local), force_block0=bool(force_block0),
                                 workspace=_dl(workspace), stream=_stream(qidx))
        return idx
    if format == "tile":
        idx, cnt = _tile_lists_out(qidx, "token_max_select", B, Hkv, Lq, top_k, kmax, out)
        _native.token_max_select(_dl(qidx), _dl(kidx), _dl(idx), _dl(cnt), top_k=top_k,
                                 precision=precision, causal=bool(causal),
                                 reserve_local=bool(reserve_local), force_block0=bool(force_block0),
                                 workspace=_dl(workspace), stream=_stream(qidx))
        return idx, cnt
    raise Error(f"token_max_select: argument 'format': expected 'query' or 'tile', got {format!r}")


def token_max_workspace_bytes(qidx, kidx, *, format="query", precision="bf16") -> int:
    """Bytes of device scratch a CUDA token_max_select of qidx, kidx takes (0 on the CPU)."""
    if format not in ("query", "tile"):
        raise Error(f"token_max_workspace_bytes: argument 'format': expected 'query' or 'tile', got {format!r}")
    return _native.token_max_workspace_bytes(_dl(qidx), _dl(kidx), tiles=(format == "tile"), precision=precision)


def lightning_select(qI, w, kI, *, top_k=2048, causal=False, precision="fp8_e4m3", groups=1,
                     format="token", kmax=None, out=None, sink_keys=0, workspace=None):
    """DSA lightning indexer: I[t, s] = sum_j w[t, j] * relu(qI[t, j] . kI[s]) with qI [B, Lq, HI, Di],
    w float32 [B, Lq, HI], kI [B, Lk, Di]. format="token": TokenLists idx [B, groups, Lq, kmax] of
    key positions; format="query": QueryLists of blocks (scores max-pooled over each block). The
    same lists are written for each of the `groups` KV groups. out= writes into a caller's idx
    [B, groups, Lq, kmax] instead. sink_keys: keys 0 .. sink_keys - 1 (those a query sees) are always
    selected and count towards top_k (the block form forces their blocks). On the CPU the lists are the
    exact top-k of float64 scores; on the GPU a top-k up to the bound of docs/design.md §5.7.
    workspace: uint8 device scratch of at least lightning_workspace_bytes(...) (default: the library's
    own per device and stream)."""
    B, Lq, _, _ = _shape(qI, "lightning_select", "qI", 4)
    if format not in ("token", "query"):
        raise Error(f"lightning_select: argument 'format': expected 'token' or 'query', got {format!r}")
    if out is None:
        groups = _int("lightning_select", "groups", groups, 1)
        idx = _full(qI, (B, groups, Lq, _kmax("lightning_select", top_k, kmax)), -1, "int32")
    else:
        idx = out
    _native.lightning_select(_dl(qI), _dl(w), _dl(kI), _dl(idx), blocks=(format == "query"),
                             top_k=top_k, causal=bool(causal), precision=precision,
                             sink_keys=_int("lightning_select", "sink_keys", sink_keys, 0),
                             workspace=_dl(workspace), stream=_stream(qI))
    return idx


def lightning_workspace_bytes(qI, kI, *, top_k=2048, precision="fp8_e4m3", format="token") -> int:
    """Bytes of device scratch a CUDA lightning_select of qI, kI takes (0 on the CPU)."""
    if format not in ("token", "query"):
        raise Error(f"lightning_workspace_bytes: argument 'format': expected 'token' or 'query', got {format!r}")
    return _native.lightning_workspace_bytes(_dl(qI), _dl(kI), blocks=(format == "query"), top_k=top_k,
                                             precision=precision)


# ---- formats ----------------------------------------------------------------------------------

def problem_shape(q, k, *, causal=False) -> ProblemShape:
    """The ProblemShape of q [B, Lq, Hq, D] and k [B, Lk, Hkv, D]."""
    B, Lq, Hq, D = _shape(q, "problem_shape", "q", 4)
    _, Lk, Hkv, _ = _shape(k, "problem_shape", "k", 4)
    return ProblemShape(B, Lq, Lk, Hq, Hkv, D, bool(causal))


def _on_host(x):
    """x where the CPU can read it: a torch tensor on another device is copied to the host."""
    if _is_torch(x) and x.device.type != "cpu":
        return x.detach().cpu()
    return x


def validate(shape: ProblemShape, *, tiles=None, bits=None, query_lists=None, token_lists=None,
             op="validate"):
    """Checks one selection against a problem shape; raises Error naming the first offending
    coordinate (ids out of range, duplicates, counts over capacity, unsorted lists, stray bits).

    The contents are checked wherever the selection lives: torch tensors on a GPU are copied to the
    host first (this synchronises with their stream, which an explicit check may), and a device
    array that is not a torch tensor is refused with an Error rather than left unchecked."""
    if tiles is not None and isinstance(tiles, (tuple, list)):
        tiles = type(tiles)(_on_host(t) for t in tiles)
    bits, query_lists, token_lists = (_on_host(s) for s in (bits, query_lists, token_lists))
    kind, a, b = _selection(op, tiles, bits, query_lists, token_lists)
    _native.validate(kind, a, b, shape, op)


def tile_lists_to_block_bits(idx, cnt, shape: ProblemShape, *, trusted=False):
    """TileLists -> BlockBits uint32 [B, G, Tq, ceil(Tk / 32)]. CUDA tensors are converted on the
    device, on the current stream; trusted=True skips their check (no synchronisation): counts are
    clamped to [0, Kmax] and ids outside [0, Tk) ignored."""
    B, G, Tq, _ = _shape(idx, "tile_lists_to_block_bits", "in.idx", 4)
    shape = _problem("tile_lists_to_block_bits", shape)
    bits = _empty(idx, (B, G, Tq, _ceil_div(shape.Tk, 32)), "uint32")
    _native.tile_lists_to_block_bits(_dl(idx), _dl(cnt), _dl(bits), shape, trusted=bool(trusted), stream=_stream(idx))
    return bits


def block_bits_to_tile_lists(bits, shape: ProblemShape, *, kmax=None, trusted=False):
    """BlockBits -> TileLists (ascending ids; slots past cnt hold -1). kmax defaults to Tk. CUDA
    tensors are converted on the device, on the current stream; trusted=True skips their check for
    stray bits and capacity (no synchronisation), ignores bits at or past Tk and needs kmax >= Tk."""
    B, G, Tq, _ = _shape(bits, "block_bits_to_tile_lists", "in.bits", 4)
    shape = _problem("block_bits_to_tile_lists", shape)
    kmax = shape.Tk if kmax is None else _int("block_bits_to_tile_lists", "kmax", kmax, 0)
    idx = _full(bits, (B, G, Tq, kmax), -1, "int32")
    cnt = _empty(bits, (B, G, Tq), "int32")
    _native.block_bits_to_tile_lists(_dl(bits), _dl(idx), _dl(cnt), shape, trusted=bool(trusted),
                                     stream=_stream(bits))
    return idx, cnt


def query_lists_to_tile_lists(lists, shape: ProblemShape, *, kmax=None, trusted=False, out=None):
    """QueryLists -> TileLists: the union of the lists of each tile's queries, ascending. kmax
    defaults to Tk. CUDA tensors are converted on the device, on the current stream; trusted=True
    skips their validation (no synchronisation) and needs kmax >= min(Tk, min(128, Lq) * Kq).
    out=(idx, cnt) writes into those tensors instead (kmax is then idx's last extent)."""
    B, Hkv, _, _ = _shape(lists, "query_lists_to_tile_lists", "in.idx", 4)
    shape = _problem("query_lists_to_tile_lists", shape)
    kmax = shape.Tk if kmax is None else _int("query_lists_to_tile_lists", "kmax", kmax, 0)
    if out is not None:
        idx, cnt = _pair(out, "query_lists_to_tile_lists")
    else:
        idx = _full(lists, (B, Hkv, shape.Tq, kmax), -1, "int32")
        cnt = _empty(lists, (B, Hkv, shape.Tq), "int32")
    _native.query_lists_to_tile_lists(_dl(lists), _dl(idx), _dl(cnt), shape, trusted=bool(trusted),
                                      stream=_stream(lists))
    return idx, cnt


def plan_schedule(lists, shape: ProblemShape, *, partials="f32", merge_window=0) -> dict:
    """The planner on QueryLists (int32 [B, Hkv, Lq, Kq] on the CPU; a CUDA tensor is
    copied to the host): which schedule runs them fastest, q_centric (query_lists_to_tile_lists then
    tile_sparse), kv_centric or group_centric. Returns a dict: "schedule", the estimates
    "q_centric_ms", "kv_centric_ms", "group_centric_ms" (inf where the kernel does not run the
    shape), "merge_window" (the KV-centric window the estimate assumes), "reason" (one line) and
    "stats" (the selection's statistics: tiles, queries, query_blocks, tile_union, selected_pairs,
    union_per_tile, neighbour_overlap, ...). partials and merge_window as query_sparse takes them."""
    if _is_torch(lists) and lists.device.type != "cpu":
        lists = lists.cpu()
    return _native.plan_schedule(_dl(lists), _problem("plan_schedule", shape), partials=partials,
                                 merge_window=merge_window)


def expand_mask(shape: ProblemShape, *, tiles=None, bits=None, query_lists=None, token_lists=None):
    """The explicit mask (numpy uint8 [B, Hq, Lq, Lk], 1 = selected and visible) of a selection on
    CPU arrays; none given: the dense (causal when shape.causal) mask. For tests and small problems."""
    kind, a, b = _selection("expand_mask", tiles, bits, query_lists, token_lists)
    return _native.expand_mask(kind, a, b, shape)


def evaluate(q, k, v, *, tiles=None, bits=None, query_lists=None, token_lists=None,
             softmax_scale=None, causal=False):
    """Selection quality (CPU arrays, float64): kept dense softmax mass (mean, min, per head), the
    output relative error against dense attention, token and block sparsity. Returns a dict."""
    kind, a, b = _selection("evaluate_selection", tiles, bits, query_lists, token_lists)
    return _native.evaluate_selection(_dl(q), _dl(k), _dl(v), kind, a, b,
                                      softmax_scale=softmax_scale, causal=bool(causal))


def calibrate_thresholds(samples, budgets, *, softmax_scale=None, sink_blocks=1, model="") -> ThresholdTable:
    """Gate thresholds of gated from calibration samples (docs/design.md §5.5). samples: an iterable
    (a generator streams them) of samples, each a sequence over layers of (q [1, L, Hq, D],
    k [1, L, Hkv, D]) pairs, numpy or torch; on a CUDA device (bf16 or f16, D <= 128) the block
    maxima are computed by the GPU. Per sample, layer, head and gate tile: the k-th largest maximum of
    the gate's candidate blocks for each budget k (-inf below k candidates), averaged over samples.
    Returns the ThresholdTable (its sink_blocks is the one to give gated)."""
    budgets = [_int("calibrate_thresholds", "budgets", b, 1) for b in budgets]
    cal = None
    for sample in samples:
        layers = list(sample)
        if cal is None:
            cal = Calibrator(budgets, len(layers), model,
                             sink_blocks=_int("calibrate_thresholds", "sink_blocks", sink_blocks, 0))
        for layer, (q, k) in enumerate(layers):
            cal.add(layer, _dl(q), _dl(k), softmax_scale)
    if cal is None:
        raise Error("calibrate_thresholds: argument 'samples': no calibration sample")
    return cal.finish()


def load_thresholds(path) -> ThresholdTable:
    """Reads a ThresholdTable saved by ThresholdTable.save (safetensors)."""
    return ThresholdTable.load(str(path))
