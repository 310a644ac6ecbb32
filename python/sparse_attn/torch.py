"""PyTorch integration: every executor and selector as a ``torch.library`` custom op in the
``sparse_attn::`` namespace, and an attention function for Hugging Face transformers.

A call into a C extension breaks a torch.compile graph; a custom op with a fake (meta) kernel does
not. The functional ops allocate their outputs; the ``*_out`` ops write into caller tensors and list
them in ``mutates_args``. Tensors reach the library through DLPack exported with ``stream=-1`` (no
producer synchronisation) and the kernels run on the current CUDA stream of q's device, so the ops
are safe inside CUDA graphs. There is no backward: these are inference (prefill) kernels.

    import sparse_attn.torch as sat
    out, lse = torch.ops.sparse_attn.dense(q, k, v, None, True)
    out = sat.tile_sparse(q, k, v, idx, cnt, causal=True)          # same, with flash-attn arguments
    sat.register_hf_attention("sa", method="token_max", budget=0.25)  # attn_implementation="sa"
"""

import contextlib
import functools
import inspect
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _GATED_COUNTS, BLOCK_K, GATE_ROWS, TILE_Q, Error, _dl, _ext, _gated_stats, _int, _kmax, _stream

__all__ = [
    "bits_sparse", "dense", "entmax", "gated", "lightning_select", "make_hf_attention", "pooled_select",
    "query_sparse", "register_hf_attention", "tile_sparse", "token_max_select", "token_sparse",
]


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# The dimensions of the arguments whose shapes the ops read before the library checks them.
_RANKS = {"q": 4, "k": 4, "v": 4, "qidx": 4, "kidx": 4, "qI": 4, "w": 3, "kI": 3}


def _check_args(op, args):
    """Ranks first (a rank-3 q would fail at unpacking its shape), then one device for every tensor:
    the dispatcher runs the fake kernel for a meta q whatever k and v are, and the fake would
    return uninitialised tensors on the device of q."""
    first = None
    for name, t in args.items():
        if not isinstance(t, Tensor):
            continue
        rank = _RANKS.get(name)
        if rank is not None and t.dim() != rank:
            raise Error(f"{op}: argument '{name}': expected {rank} dimensions, got shape {list(t.shape)}")
        if first is None:
            first = name, t.device
        elif t.device != first[1]:
            raise Error(f"{op}: argument '{name}': is on {t.device} but '{first[0]}' is on {first[1]}")


def _checked(op, fn):
    """fn with _check_args before it (the signature seen by torch.library stays fn's)."""
    names = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        given = dict(zip(names, args))
        given.update(kwargs)
        _check_args(op, given)
        return fn(*args, **kwargs)
    return checked


_OP_NAMES = {}  # custom op -> its name in sparse_attn::


def _custom_op(name, mutates_args):
    """torch.library.custom_op sparse_attn::name over the checked implementation."""
    def define(fn):
        op = torch.library.custom_op(f"sparse_attn::{name}", _checked(name, fn), mutates_args=mutates_args)
        _OP_NAMES[op] = name
        return op
    return define


def _fake(op):
    """Registers the checked fake (meta) kernel of op."""
    return lambda fn: op.register_fake(_checked(_OP_NAMES[op], fn))


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _out_like(q: Tensor) -> Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _lse_like(q: Tensor) -> Tensor:
    B, Lq, Hq, _ = q.shape
    return torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)


def _fake_out_lse(q: Tensor) -> Tuple[Tensor, Tensor]:
    B, Lq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Lq), dtype=torch.float32)


# ---- executors: functional ops --------------------------------------------------------------------

@_custom_op("dense", mutates_args=())
def _dense(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool) -> Tuple[Tensor, Tensor]:
    out, lse = _out_like(q), _lse_like(q)
    with _device(q):
        _ext.dense(_dl(q), _dl(k), _dl(v), _dl(out), _dl(lse), softmax_scale=softmax_scale, causal=causal,
                   stream=_stream(q))
    return out, lse


@_fake(_dense)
def _(q, k, v, softmax_scale, causal):
    return _fake_out_lse(q)


@_custom_op("tile_sparse", mutates_args=())
def _tile_sparse(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, cnt: Tensor, softmax_scale: Optional[float],
                 causal: bool, trusted: bool) -> Tuple[Tensor, Tensor]:
    out, lse = _out_like(q), _lse_like(q)
    with _device(q):
        _ext.tile_sparse(_dl(q), _dl(k), _dl(v), _dl(idx), _dl(cnt), _dl(out), _dl(lse),
                         softmax_scale=softmax_scale, causal=causal, trusted=trusted, stream=_stream(q))
    return out, lse


@_fake(_tile_sparse)
def _(q, k, v, idx, cnt, softmax_scale, causal, trusted):
    return _fake_out_lse(q)


@_custom_op("bits_sparse", mutates_args=())
def _bits_sparse(q: Tensor, k: Tensor, v: Tensor, bits: Tensor, softmax_scale: Optional[float], causal: bool,
                 trusted: bool) -> Tuple[Tensor, Tensor]:
    out, lse = _out_like(q), _lse_like(q)
    with _device(q):
        _ext.bits_sparse(_dl(q), _dl(k), _dl(v), _dl(bits), _dl(out), _dl(lse), softmax_scale=softmax_scale,
                         causal=causal, trusted=trusted, stream=_stream(q))
    return out, lse


@_fake(_bits_sparse)
def _(q, k, v, bits, softmax_scale, causal, trusted):
    return _fake_out_lse(q)


@_custom_op("query_sparse", mutates_args=())
def _query_sparse(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, softmax_scale: Optional[float], causal: bool,
                  trusted: bool, partials: str, schedule: str, merge_window: int) -> Tuple[Tensor, Tensor]:
    out, lse = _out_like(q), _lse_like(q)
    with _device(q):
        _ext.query_sparse(_dl(q), _dl(k), _dl(v), _dl(idx), _dl(out), _dl(lse), softmax_scale=softmax_scale,
                          causal=causal, trusted=trusted, partials=partials, schedule=schedule,
                          merge_window=merge_window, stream=_stream(q))
    return out, lse


@_fake(_query_sparse)
def _(q, k, v, idx, softmax_scale, causal, trusted, partials, schedule, merge_window):
    return _fake_out_lse(q)


@_custom_op("token_sparse", mutates_args=())
def _token_sparse(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, softmax_scale: Optional[float], causal: bool,
                  trusted: bool) -> Tuple[Tensor, Tensor]:
    out, lse = _out_like(q), _lse_like(q)
    with _device(q):
        _ext.token_sparse(_dl(q), _dl(k), _dl(v), _dl(idx), _dl(out), _dl(lse), softmax_scale=softmax_scale,
                          causal=causal, trusted=trusted, stream=_stream(q))
    return out, lse


@_fake(_token_sparse)
def _(q, k, v, idx, softmax_scale, causal, trusted):
    return _fake_out_lse(q)


@_custom_op("gated", mutates_args=())
def _gated(q: Tensor, k: Tensor, v: Tensor, thresholds: Tensor, softmax_scale: Optional[float],
           sink_blocks: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, kept_per_tile, counts): counts int32 [4] on q's device holds the gate's counters
    in the order of sparse_attn._GATED_COUNTS, written by the kernel (no synchronisation)."""
    out, lse = _out_like(q), _lse_like(q)
    B, Lq, Hq, _ = q.shape
    kept = torch.empty((B, Hq, _cdiv(Lq, GATE_ROWS)), dtype=torch.int32, device=q.device)
    counts = torch.empty((len(_GATED_COUNTS),), dtype=torch.int32, device=q.device)
    with _device(q):
        _ext.gated(_dl(q), _dl(k), _dl(v), _dl(thresholds), _dl(out), _dl(lse), softmax_scale=softmax_scale,
                   kept_per_tile=_dl(kept), stream=_stream(q), sink_blocks=sink_blocks, counts=_dl(counts))
    return out, lse, kept, counts


@_fake(_gated)
def _(q, k, v, thresholds, softmax_scale, sink_blocks):
    B, Lq, Hq, _ = q.shape
    out, lse = _fake_out_lse(q)
    return (out, lse, q.new_empty((B, Hq, _cdiv(Lq, GATE_ROWS)), dtype=torch.int32),
            q.new_empty((len(_GATED_COUNTS),), dtype=torch.int32))


@_custom_op("entmax", mutates_args=())
def _entmax(q: Tensor, k: Tensor, v: Tensor, alpha: float, softmax_scale: Optional[float], causal: bool,
            histogram_bins: int) -> Tuple[Tensor, Tensor]:
    out = _out_like(q)
    B, Lq, Hq, _ = q.shape
    bits = torch.empty((B, Hq, _cdiv(Lq, TILE_Q), _cdiv(_cdiv(k.shape[1], BLOCK_K), 32)), dtype=torch.uint32,
                       device=q.device)
    with _device(q):
        _ext.entmax(_dl(q), _dl(k), _dl(v), _dl(out), alpha=alpha, softmax_scale=softmax_scale, causal=causal,
                    histogram_bins=histogram_bins, block_bits=_dl(bits), stream=_stream(q))
    return out, bits


@_fake(_entmax)
def _(q, k, v, alpha, softmax_scale, causal, histogram_bins):
    B, Lq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, _cdiv(Lq, TILE_Q), _cdiv(_cdiv(k.shape[1], BLOCK_K), 32)),
                                             dtype=torch.uint32)


# ---- executors: ops that write into caller tensors --------------------------------------------------

@_custom_op("dense_out", mutates_args=("out", "lse"))
def _dense_out(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Optional[Tensor], softmax_scale: Optional[float],
               causal: bool) -> None:
    with _device(q):
        _ext.dense(_dl(q), _dl(k), _dl(v), _dl(out), _dl(lse), softmax_scale=softmax_scale, causal=causal,
                   stream=_stream(q))


@_fake(_dense_out)
def _(q, k, v, out, lse, softmax_scale, causal):
    return None


@_custom_op("tile_sparse_out", mutates_args=("out", "lse"))
def _tile_sparse_out(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, cnt: Tensor, out: Tensor, lse: Optional[Tensor],
                     softmax_scale: Optional[float], causal: bool, trusted: bool) -> None:
    with _device(q):
        _ext.tile_sparse(_dl(q), _dl(k), _dl(v), _dl(idx), _dl(cnt), _dl(out), _dl(lse),
                         softmax_scale=softmax_scale, causal=causal, trusted=trusted, stream=_stream(q))


@_fake(_tile_sparse_out)
def _(q, k, v, idx, cnt, out, lse, softmax_scale, causal, trusted):
    return None


@_custom_op("bits_sparse_out", mutates_args=("out", "lse"))
def _bits_sparse_out(q: Tensor, k: Tensor, v: Tensor, bits: Tensor, out: Tensor, lse: Optional[Tensor],
                     softmax_scale: Optional[float], causal: bool, trusted: bool) -> None:
    with _device(q):
        _ext.bits_sparse(_dl(q), _dl(k), _dl(v), _dl(bits), _dl(out), _dl(lse), softmax_scale=softmax_scale,
                         causal=causal, trusted=trusted, stream=_stream(q))


@_fake(_bits_sparse_out)
def _(q, k, v, bits, out, lse, softmax_scale, causal, trusted):
    return None


@_custom_op("query_sparse_out", mutates_args=("out", "lse"))
def _query_sparse_out(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, out: Tensor, lse: Optional[Tensor],
                      softmax_scale: Optional[float], causal: bool, trusted: bool, partials: str,
                      schedule: str, merge_window: int) -> None:
    with _device(q):
        _ext.query_sparse(_dl(q), _dl(k), _dl(v), _dl(idx), _dl(out), _dl(lse), softmax_scale=softmax_scale,
                          causal=causal, trusted=trusted, partials=partials, schedule=schedule,
                          merge_window=merge_window, stream=_stream(q))


@_fake(_query_sparse_out)
def _(q, k, v, idx, out, lse, softmax_scale, causal, trusted, partials, schedule, merge_window):
    return None


@_custom_op("token_sparse_out", mutates_args=("out", "lse"))
def _token_sparse_out(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, out: Tensor, lse: Optional[Tensor],
                      softmax_scale: Optional[float], causal: bool, trusted: bool) -> None:
    with _device(q):
        _ext.token_sparse(_dl(q), _dl(k), _dl(v), _dl(idx), _dl(out), _dl(lse), softmax_scale=softmax_scale,
                          causal=causal, trusted=trusted, stream=_stream(q))


@_fake(_token_sparse_out)
def _(q, k, v, idx, out, lse, softmax_scale, causal, trusted):
    return None


# ---- selectors -----------------------------------------------------------------------------------

@_custom_op("pooled_select", mutates_args=())
def _pooled_select(q: Tensor, k: Tensor, top_k: int, kmax: int, representatives: int, force_local: bool,
                   force_block0: bool, causal: bool) -> Tuple[Tensor, Tensor]:
    B, Lq = q.shape[0], q.shape[1]
    Hkv = k.shape[2]
    idx = torch.full((B, Hkv, _cdiv(Lq, TILE_Q), kmax), -1, dtype=torch.int32, device=q.device)
    cnt = torch.empty((B, Hkv, _cdiv(Lq, TILE_Q)), dtype=torch.int32, device=q.device)
    with _device(q):
        _ext.pooled_select(_dl(q), _dl(k), _dl(idx), _dl(cnt), representatives=representatives, top_k=top_k,
                           force_local=force_local, force_block0=force_block0, causal=causal, stream=_stream(q))
    return idx, cnt


@_fake(_pooled_select)
def _(q, k, top_k, kmax, representatives, force_local, force_block0, causal):
    B, Lq, Hkv = q.shape[0], q.shape[1], k.shape[2]
    Tq = _cdiv(Lq, TILE_Q)
    return q.new_empty((B, Hkv, Tq, kmax), dtype=torch.int32), q.new_empty((B, Hkv, Tq), dtype=torch.int32)


@_custom_op("token_max_select", mutates_args=())
def _token_max_select(qidx: Tensor, kidx: Tensor, top_k: int, kmax: int, precision: str, causal: bool,
                      reserve_local: bool, force_block0: bool) -> Tensor:
    B, Lq, Hkv, _ = qidx.shape
    idx = torch.full((B, Hkv, Lq, kmax), -1, dtype=torch.int32, device=qidx.device)
    with _device(qidx):
        _ext.token_max_select(_dl(qidx), _dl(kidx), _dl(idx), None, top_k=top_k, precision=precision,
                              causal=causal, reserve_local=reserve_local, force_block0=force_block0,
                              stream=_stream(qidx))
    return idx


@_fake(_token_max_select)
def _(qidx, kidx, top_k, kmax, precision, causal, reserve_local, force_block0):
    B, Lq, Hkv, _ = qidx.shape
    return qidx.new_empty((B, Hkv, Lq, kmax), dtype=torch.int32)


@_custom_op("token_max_select_tiles", mutates_args=())
def _token_max_select_tiles(qidx: Tensor, kidx: Tensor, top_k: int, kmax: int, precision: str, causal: bool,
                            reserve_local: bool, force_block0: bool) -> Tuple[Tensor, Tensor]:
    B, Lq, Hkv, _ = qidx.shape
    Tq = _cdiv(Lq, TILE_Q)
    idx = torch.full((B, Hkv, Tq, kmax), -1, dtype=torch.int32, device=qidx.device)
    cnt = torch.empty((B, Hkv, Tq), dtype=torch.int32, device=qidx.device)
    with _device(qidx):
        _ext.token_max_select(_dl(qidx), _dl(kidx), _dl(idx), _dl(cnt), top_k=top_k, precision=precision,
                              causal=causal, reserve_local=reserve_local, force_block0=force_block0,
                              stream=_stream(qidx))
    return idx, cnt


@_fake(_token_max_select_tiles)
def _(qidx, kidx, top_k, kmax, precision, causal, reserve_local, force_block0):
    B, Lq, Hkv, _ = qidx.shape
    Tq = _cdiv(Lq, TILE_Q)
    return qidx.new_empty((B, Hkv, Tq, kmax), dtype=torch.int32), qidx.new_empty((B, Hkv, Tq), dtype=torch.int32)


@_custom_op("lightning_select", mutates_args=())
def _lightning_select(qI: Tensor, w: Tensor, kI: Tensor, top_k: int, kmax: int, groups: int, blocks: bool,
                      causal: bool, precision: str, sink_keys: int) -> Tensor:
    B, Lq = qI.shape[0], qI.shape[1]
    idx = torch.full((B, groups, Lq, kmax), -1, dtype=torch.int32, device=qI.device)
    with _device(qI):
        _ext.lightning_select(_dl(qI), _dl(w), _dl(kI), _dl(idx), blocks=blocks, top_k=top_k, causal=causal,
                              precision=precision, sink_keys=sink_keys, stream=_stream(qI))
    return idx


@_fake(_lightning_select)
def _(qI, w, kI, top_k, kmax, groups, blocks, causal, precision, sink_keys):
    return qI.new_empty((qI.shape[0], groups, qI.shape[1], kmax), dtype=torch.int32)


# ---- flash-attn style wrappers over the ops ---------------------------------------------------------

def _scale(softmax_scale):
    return None if softmax_scale is None else float(softmax_scale)


def _finish(out, lse, return_lse):
    return (out, lse) if return_lse else out


def _lse_for(q, return_lse):
    return _lse_like(q) if return_lse else None


def dense(q, k, v, *, softmax_scale=None, causal=False, return_lse=False, out=None):
    """Dense attention through torch.ops.sparse_attn.dense (or dense_out with out=)."""
    if out is None:
        o, lse = torch.ops.sparse_attn.dense(q, k, v, _scale(softmax_scale), bool(causal))
        return _finish(o, lse, return_lse)
    lse = _lse_for(q, return_lse)
    torch.ops.sparse_attn.dense_out(q, k, v, out, lse, _scale(softmax_scale), bool(causal))
    return _finish(out, lse, return_lse)


def tile_sparse(q, k, v, idx, cnt, *, softmax_scale=None, causal=False, return_lse=False, out=None, trusted=False):
    if out is None:
        o, lse = torch.ops.sparse_attn.tile_sparse(q, k, v, idx, cnt, _scale(softmax_scale), bool(causal),
                                                   bool(trusted))
        return _finish(o, lse, return_lse)
    lse = _lse_for(q, return_lse)
    torch.ops.sparse_attn.tile_sparse_out(q, k, v, idx, cnt, out, lse, _scale(softmax_scale), bool(causal),
                                          bool(trusted))
    return _finish(out, lse, return_lse)


def bits_sparse(q, k, v, bits, *, softmax_scale=None, causal=False, return_lse=False, out=None, trusted=False):
    if out is None:
        o, lse = torch.ops.sparse_attn.bits_sparse(q, k, v, bits, _scale(softmax_scale), bool(causal), bool(trusted))
        return _finish(o, lse, return_lse)
    lse = _lse_for(q, return_lse)
    torch.ops.sparse_attn.bits_sparse_out(q, k, v, bits, out, lse, _scale(softmax_scale), bool(causal),
                                          bool(trusted))
    return _finish(out, lse, return_lse)


def query_sparse(q, k, v, idx, *, partials="f32", softmax_scale=None, causal=False, return_lse=False, out=None,
                 trusted=False, schedule="kv_centric", merge_window=0):
    if out is None:
        o, lse = torch.ops.sparse_attn.query_sparse(q, k, v, idx, _scale(softmax_scale), bool(causal),
                                                    bool(trusted), str(partials), str(schedule),
                                                    int(merge_window))
        return _finish(o, lse, return_lse)
    lse = _lse_for(q, return_lse)
    torch.ops.sparse_attn.query_sparse_out(q, k, v, idx, out, lse, _scale(softmax_scale), bool(causal),
                                           bool(trusted), str(partials), str(schedule), int(merge_window))
    return _finish(out, lse, return_lse)


def token_sparse(q, k, v, idx, *, softmax_scale=None, causal=False, return_lse=False, out=None, trusted=False):
    if out is None:
        o, lse = torch.ops.sparse_attn.token_sparse(q, k, v, idx, _scale(softmax_scale), bool(causal), bool(trusted))
        return _finish(o, lse, return_lse)
    lse = _lse_for(q, return_lse)
    torch.ops.sparse_attn.token_sparse_out(q, k, v, idx, out, lse, _scale(softmax_scale), bool(causal),
                                           bool(trusted))
    return _finish(out, lse, return_lse)


def gated(q, k, v, thresholds, *, softmax_scale=None, return_lse=False, return_kept_per_tile=False,
          sink_blocks=1, stats=True):
    """Through torch.ops.sparse_attn.gated; returns what sparse_attn.gated returns: (out, stats) or,
    with return_lse, (out, lse, stats), stats the dict of the gate's counters and density (plus
    "kept_per_tile", int32 [B, Hq, ceil(Lq / GATE_ROWS)] on q's device, with return_kept_per_tile).
    Reading the counters waits for the device; with stats=False, stats is {"counts": int32 [4] on
    q's device (order of sparse_attn._GATED_COUNTS)} and nothing waits."""
    if not isinstance(thresholds, Tensor):
        thresholds = torch.as_tensor(thresholds, dtype=torch.float32, device=q.device)
    o, lse, kept, counts = torch.ops.sparse_attn.gated(q, k, v, thresholds, _scale(softmax_scale),
                                                       _int("gated", "sink_blocks", sink_blocks))
    kept = kept if return_kept_per_tile else None
    if stats:
        result = _gated_stats(counts.tolist(), kept)
    else:
        result = {"counts": counts} if kept is None else {"counts": counts, "kept_per_tile": kept}
    return (o, lse, result) if return_lse else (o, result)


def entmax(q, k, v, *, alpha=1.5, softmax_scale=None, causal=False, histogram_bins=64, return_block_bits=False):
    out, bits = torch.ops.sparse_attn.entmax(q, k, v, float(alpha), _scale(softmax_scale), bool(causal),
                                             int(histogram_bins))
    return (out, bits) if return_block_bits else out


def pooled_select(q, k, *, top_k=16, representatives=1, force_local=True, force_block0=False, causal=False,
                  kmax=None):
    return torch.ops.sparse_attn.pooled_select(q, k, _int("pooled_select", "top_k", top_k),
                                               _kmax("pooled_select", top_k, kmax),
                                               int(representatives), bool(force_local), bool(force_block0),
                                               bool(causal))


def token_max_select(qidx, kidx, *, top_k=16, precision="bf16", causal=False, reserve_local=True,
                     force_block0=False, format="query", kmax=None):
    kmax = _kmax("token_max_select", top_k, kmax)
    top_k = _int("token_max_select", "top_k", top_k)
    if format == "query":
        return torch.ops.sparse_attn.token_max_select(qidx, kidx, top_k, kmax, str(precision), bool(causal),
                                                      bool(reserve_local), bool(force_block0))
    if format == "tile":
        return torch.ops.sparse_attn.token_max_select_tiles(qidx, kidx, top_k, kmax, str(precision),
                                                            bool(causal), bool(reserve_local), bool(force_block0))
    raise Error(f"token_max_select: argument 'format': expected 'query' or 'tile', got {format!r}")


def lightning_select(qI, w, kI, *, top_k=2048, causal=False, precision="fp8_e4m3", groups=1, format="token",
                     kmax=None, sink_keys=0):
    if format not in ("token", "query"):
        raise Error(f"lightning_select: argument 'format': expected 'token' or 'query', got {format!r}")
    return torch.ops.sparse_attn.lightning_select(qI, w, kI, _int("lightning_select", "top_k", top_k),
                                                  _kmax("lightning_select", top_k, kmax),
                                                  _int("lightning_select", "groups", groups, 1), format == "query",
                                                  bool(causal), str(precision),
                                                  _int("lightning_select", "sink_keys", sink_keys, 0))


# ---- Hugging Face transformers -------------------------------------------------------------------

def make_hf_attention(*args, **kwargs):
    """sparse_attn.hf.make_hf_attention (every method behind the transformers attention interface)."""
    from .hf import make_hf_attention as make
    return make(*args, **kwargs)


def register_hf_attention(*args, **kwargs):
    """sparse_attn.hf.register_hf_attention: registers an attention implementation with transformers."""
    from .hf import register_hf_attention as register
    return register(*args, **kwargs)
