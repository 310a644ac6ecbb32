"""Every sparse_attn method behind the Hugging Face transformers attention interface.

    import sparse_attn.hf as sah
    sah.register_hf_attention("sa_tm", method="token_max", budget=0.25)   # 25 % of the key blocks
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="sa_tm")

Methods (``method=``):

* ``dense``: the library's dense attention.
* ``pooled``: the R1 (``representatives=1``) or R4 pooled selector -> tile_sparse.
* ``token_max``: the MSA token-max selector on index vectors -> tile_sparse (``granularity="tile"``)
  or query_sparse (``granularity="query"``). The index vectors are the layer's own post-RoPE q
  (averaged over each GQA group) and k, or what ``indexer(module, q, k) -> (qidx, kidx)`` returns.
* ``lightning``: the DSA lightning indexer -> token_sparse (``lightning_format="token"``, budget x
  128 keys per query) or query_sparse over its block lists (``"block"``). Without ``indexer`` each
  KV group's selection scores its own query heads (weights 1 / group size) against its own keys;
  ``indexer(module, q, k) -> (qI, w, kI)`` supplies a trained indexer shared by all groups.
* ``gated``: BSFA gating per gate tile of GATE_ROWS queries with a calibrated ThresholdTable
  (``thresholds=`` a path or a table; the layer is ``module.layer_idx``; the table's sink_blocks
  are kept as it was calibrated). ``budget`` b picks the table's slice for b - 1 - sink_blocks gated
  blocks (at least 1; the diagonal block and the sinks are always kept), so the gate keeps about b
  blocks. Causal only.
* ``entmax``: alpha-entmax attention (``alpha=``), for models trained with it.
* ``oracle``: the top ``budget`` blocks of each Q tile by exact attention mass (summed over the
  tile's queries and the group's heads), computed with torch: the upper bound a block selector of
  that budget can reach, for evaluation.
* ``auto``: token_max's per-query lists, and the planner (``plan_schedule``) picks the executor:
  Q-centric tile_sparse, KV-centric or group-centric query_sparse.

Options: ``budget`` is blocks per Q tile (per query for query-granular lists) when an int, or a
fraction of the sequence's key blocks when a float in (0, 1]; the forced blocks count towards it.
``sink_blocks`` (leading key blocks) and ``local_blocks`` (the query's own block and those before
it) are part of every selection (gated keeps the diagonal and its table's sink blocks; entmax and
dense need none). Sequences with fewer than ``min_length`` keys run dense. GQA is native: selections are per KV group (gated and entmax: per
query head) and K/V are never repeated.

Decode and padding: a call with one query (a decode step with a KV cache) runs dense attention,
exactly; longer chunks with a cache (Lq < Lk) run the method with bottom-right causal alignment.
A batch with padding raises Error: the kernels apply only the causal rule.

``recorder=`` (a Recorder) collects, per layer, the block and pair density of every call and, with
``Recorder(mass=True)``, the dense softmax mass the selection keeps (computed with torch; memory
O(Hq Lq Lk)). ``observer(module, q, k, v, scaling)`` is called on every layer's (B, L, H, D) q, k, v
before attention (calibration uses it).
"""

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from . import BLOCK_K, GATE_ROWS, TILE_Q, Error, ThresholdTable, load_thresholds, plan_schedule, problem_shape
from . import query_lists_to_tile_lists
from .torch import (dense, entmax, gated, lightning_select, pooled_select, query_sparse, tile_sparse,
                    token_max_select, token_sparse)

__all__ = ["METHODS", "Recorder", "make_hf_attention", "register_hf_attention"]

METHODS = ("dense", "pooled", "token_max", "lightning", "gated", "entmax", "oracle", "auto")

_OP = "sparse_attn attention"


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# ---- selections as boolean masks ------------------------------------------------------------------
# A selection is carried as a mask over one of three grids, G = Hkv or Hq groups:
#   "tile"  [B, G, Tq, Tk]  blocks per Q tile     "query" [B, G, Lq, Tk]  blocks per query
#   "token" [B, G, Lq, Lk]  keys per query
# Forced blocks are a union on the mask; the executors get lists made from it.

def _query_block(Lq: int, Lk: int, device) -> Tensor:
    """The key block holding each query's own position (bottom-right aligned), int64 [Lq]."""
    return (torch.arange(Lq, device=device) + (Lk - Lq)) // BLOCK_K


def _forced(grid: str, Lq: int, Lk: int, sink: int, local: int, device) -> Optional[Tensor]:
    """bool mask of the sink and local blocks on `grid` (broadcast over B, G), causal visibility
    applied; None when nothing is forced. A tile's local blocks end at its last query's block and
    reach `local` blocks before its first query's."""
    if sink <= 0 and local <= 0:
        return None
    own = _query_block(Lq, Lk, device)
    first = last = own
    if grid == "tile":
        starts = torch.arange(_cdiv(Lq, TILE_Q), device=device) * TILE_Q
        first, last = own[starts], own[torch.clamp(starts + TILE_Q - 1, max=Lq - 1)]
    blocks = torch.arange(_cdiv(Lk, BLOCK_K), device=device)[None, :]
    keep = blocks < sink
    if local > 0:
        keep = keep | (blocks > first[:, None] - local)
    keep = keep & (blocks <= last[:, None])
    if grid == "token":
        keys = torch.arange(Lk, device=device)
        keep = keep[:, keys // BLOCK_K] & (keys[None, :] <= torch.arange(Lq, device=device)[:, None] + (Lk - Lq))
    return keep


def _mask_from_lists(idx: Tensor, n: int, cnt: Optional[Tensor] = None) -> Tensor:
    """bool [..., n] from ascending lists idx [..., K] (-1 or slots past cnt empty)."""
    valid = idx >= 0
    if cnt is not None:
        valid &= torch.arange(idx.shape[-1], device=idx.device) < cnt[..., None]
    mask = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.bool, device=idx.device)
    mask.scatter_(-1, torch.where(valid, idx, n).long(), True)
    return mask[..., :n]


def _lists_from_mask(mask: Tensor, kmax: int):
    """(idx int32 [..., kmax] ascending, -1 padded, cnt int32 [...]) of a bool mask [..., n] with at
    most kmax entries per row."""
    n = mask.shape[-1]
    kmax = max(1, min(kmax, n))
    pos = torch.where(mask, torch.arange(n, device=mask.device, dtype=torch.int32), n)
    first = torch.topk(pos, kmax, dim=-1, largest=False, sorted=True).values
    return torch.where(first < n, first, -1).to(torch.int32), mask.sum(-1, dtype=torch.int32)


# ---- statistics ---------------------------------------------------------------------------------

class Recorder:
    """Per-layer statistics of the calls of one attention function: calls, block density (selected
    (query, head, visible key block) triples over visible ones), pair density (selected visible
    (query, head, key) triples over visible ones) and, with mass=True, the mean dense softmax mass
    the selection keeps. `schedules` counts the planner's choices (method "auto")."""

    def __init__(self, mass: bool = False):
        self.mass = mass
        self.layers = {}
        self.schedules = {}

    def reset(self):
        self.layers.clear()
        self.schedules.clear()

    def _add(self, layer, **counts):
        entry = self.layers.setdefault(layer, {})
        for name, value in counts.items():
            entry[name] = entry.get(name, 0) + value

    def record(self, layer, q: Tensor, k: Tensor, scale: float, causal: bool, pairs: Optional[Tensor]):
        """pairs: bool [B, G, Lq, Lk] of the selected pairs (G = Hkv or Hq), None for dense."""
        B, Lq, Hq, _ = q.shape
        Lk, Hkv = k.shape[1], k.shape[2]
        visible = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device)
        if causal:
            visible = torch.arange(Lk, device=q.device)[None, :] <= torch.arange(Lq, device=q.device)[:, None] + Lk - Lq
        if pairs is None:
            pairs = visible.expand(B, Hq, Lq, Lk)
        elif pairs.shape[1] != Hq:
            pairs = pairs.repeat_interleave(Hq // pairs.shape[1], dim=1)
        pairs = pairs & visible
        Tk = _cdiv(Lk, BLOCK_K)
        pad = Tk * BLOCK_K - Lk

        def blocks(m):
            return torch.nn.functional.pad(m, (0, pad)).view(*m.shape[:-1], Tk, BLOCK_K).any(-1)

        counts = dict(calls=1, queries=B * Hq * Lq,
                      visible_pairs=int(visible.sum()) * B * Hq, kept_pairs=int(pairs.sum()),
                      visible_blocks=int(blocks(visible).sum()) * B * Hq, kept_blocks=int(blocks(pairs).sum()))
        if self.mass:
            s = torch.einsum("bqhgd,bkhd->bhgqk", q.float().view(B, Lq, Hkv, Hq // Hkv, -1), k.float())
            s = s.reshape(B, Hq, Lq, Lk) * scale
            p = torch.softmax(s.masked_fill(~visible, -math.inf), dim=-1)
            counts["kept_mass"] = float((p * pairs).sum())
        self._add(layer, **counts)

    def summary(self) -> dict:
        """Totals and per-layer values: block_density, pair_density, kept_mass (mean per query and
        head; None without mass=True)."""
        def rates(e):
            return {
                "calls": e.get("calls", 0),
                "block_density": e["kept_blocks"] / e["visible_blocks"] if e.get("visible_blocks") else None,
                "pair_density": e["kept_pairs"] / e["visible_pairs"] if e.get("visible_pairs") else None,
                "kept_mass": e["kept_mass"] / e["queries"] if "kept_mass" in e and e.get("queries") else None,
            }
        total = {}
        for e in self.layers.values():
            for name, value in e.items():
                total[name] = total.get(name, 0) + value
        out = rates(total)
        out["per_layer"] = {layer: rates(e) for layer, e in sorted(self.layers.items(), key=lambda x: str(x[0]))}
        if self.schedules:
            out["schedules"] = dict(self.schedules)
        return out


def _pairs(grid: str, mask: Tensor, Lq: int, Lk: int) -> Tensor:
    """bool [B, G, Lq, Lk] of a selection mask on `grid`."""
    if grid == "token":
        return mask
    if grid in ("tile", "gate"):
        rows = TILE_Q if grid == "tile" else GATE_ROWS
        mask = mask[:, :, torch.arange(Lq, device=mask.device) // rows]
    return mask[..., torch.arange(Lk, device=mask.device) // BLOCK_K]


def _bits_mask(bits: Tensor, Tk: int) -> Tensor:
    """bool [B, G, Tq, Tk] of BlockBits (uint32 words)."""
    words = bits.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(32, device=bits.device)
    return ((words[..., None] >> shifts) & 1).bool().flatten(-2)[..., :Tk]


def _gate_mask(q: Tensor, k: Tensor, thresholds: Tensor, scale: float, sink_blocks: int) -> Tensor:
    """The blocks gated() keeps, bool [B, Hq, Tg, Tk] per gate tile of GATE_ROWS queries: visible
    and straddling the gate tile's diagonal, or one of the first sink_blocks, or with a block max of
    the scaled scores >= thresholds[h, min(t, T - 1)] (as reference.gated)."""
    B, L, Hq, _ = q.shape
    Hkv = k.shape[2]
    s = torch.einsum("bqhgd,bkhd->bhgqk", q.float().view(B, L, Hkv, Hq // Hkv, -1), k.float()).reshape(B, Hq, L, L)
    vis = torch.arange(L, device=q.device)[None, :] <= torch.arange(L, device=q.device)[:, None]
    s = (s * scale).masked_fill(~vis, -math.inf)
    Tg, Tk = _cdiv(L, GATE_ROWS), _cdiv(L, BLOCK_K)
    pad_q, pad_k = Tg * GATE_ROWS - L, Tk * BLOCK_K - L
    s = torch.nn.functional.pad(s, (0, pad_k, 0, pad_q), value=-math.inf).view(B, Hq, Tg, GATE_ROWS, Tk, BLOCK_K)
    bmax = s.amax(dim=(3, 5))
    v = torch.nn.functional.pad(vis, (0, pad_k, 0, pad_q)).view(Tg, GATE_ROWS, Tk, BLOCK_K)
    visible, full = v.any(dim=(1, 3)), v.all(dim=(1, 3))
    sink = torch.arange(Tk, device=q.device) < sink_blocks
    T = thresholds.shape[1]
    thr = thresholds[:, torch.clamp(torch.arange(Tg, device=q.device), max=T - 1)].to(q.device)
    return visible & ((visible & ~full) | sink | (bmax >= thr[None, :, :, None]))


# ---- the methods ----------------------------------------------------------------------------------

class _Method:
    """One configured method. __call__ takes flash-layout q [B, Lq, Hq, D], k, v [B, Lk, Hkv, D] and
    returns (out, (grid, mask) or None for dense, schedule or None)."""

    def __init__(self, method, budget, sink_blocks, local_blocks, representatives, granularity, thresholds,
                 alpha, indexer, precision, lightning_format):
        if method not in METHODS:
            raise Error(f"register_hf_attention: argument 'method': expected one of {', '.join(METHODS)}, "
                        f"got {method!r}")
        if granularity not in ("tile", "query"):
            raise Error(f"register_hf_attention: argument 'granularity': expected 'tile' or 'query', "
                        f"got {granularity!r}")
        if lightning_format not in ("token", "block"):
            raise Error(f"register_hf_attention: argument 'lightning_format': expected 'token' or 'block', "
                        f"got {lightning_format!r}")
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise TypeError(f"register_hf_attention: argument 'budget': expected int or float, got {budget!r}")
        if budget <= 0 or (isinstance(budget, float) and budget > 1):
            raise Error(f"register_hf_attention: argument 'budget': must be an int >= 1 (blocks) or a float "
                        f"in (0, 1] (fraction of the key blocks), got {budget}")
        for name, value in (("sink_blocks", sink_blocks), ("local_blocks", local_blocks)):
            if not isinstance(value, int) or value < 0:
                raise Error(f"register_hf_attention: argument '{name}': must be an int >= 0, got {value!r}")
        if method == "gated":
            if thresholds is None:
                raise Error("register_hf_attention: argument 'thresholds': method 'gated' needs a ThresholdTable "
                            "or the path of one (python -m sparse_attn.calibrate writes it)")
            if not isinstance(thresholds, ThresholdTable):
                thresholds = load_thresholds(thresholds)
            if thresholds.tile_q != GATE_ROWS or thresholds.tile_k != BLOCK_K:
                raise Error(f"register_hf_attention: argument 'thresholds': calibrated for gate tiles of "
                            f"{thresholds.tile_q}x{thresholds.tile_k}, the kernels use {GATE_ROWS}x{BLOCK_K}")
        self.method, self.budget = method, budget
        self.sink, self.local = sink_blocks, local_blocks
        self.representatives, self.granularity = representatives, granularity
        self.table = None
        if thresholds is not None:  # plain copies: no extension object lives on in transformers' registry
            self.table = dict(values=thresholds.values, budgets=list(thresholds.budgets), model=thresholds.model,
                              sink_blocks=thresholds.sink_blocks)
        self.alpha, self.indexer = alpha, indexer
        self.precision, self.lightning_format = precision, lightning_format
        self._slices = {}  # (layer, budget, device) -> thresholds tensor

    def blocks(self, Lk: int) -> int:
        """The budget in blocks for Lk keys."""
        if isinstance(self.budget, float):
            return max(1, math.ceil(self.budget * _cdiv(Lk, BLOCK_K)))
        return int(self.budget)

    def _ask(self, top, native_sink, native_local):
        """What a selector that forces native_sink / native_local blocks itself is asked for, so that
        with the other forced blocks added the selection stays within `top` blocks."""
        return max(1, top - max(self.sink - native_sink, 0) - max(self.local - native_local, 0))

    def _union(self, grid, mask, Lq, Lk, kmax):
        """mask with the forced blocks added, and the list capacity that holds it (a tile's local
        blocks may be one more than `local` where its queries straddle two blocks)."""
        forced = _forced(grid, Lq, Lk, self.sink, self.local, mask.device)
        if forced is not None:
            mask = mask | forced
            kmax += (self.sink + self.local + 1) * (BLOCK_K if grid == "token" else 1)
        return mask, kmax

    def _tiles(self, q, k, v, scale, causal, mask, kmax):
        Lq, Lk = q.shape[1], k.shape[1]
        mask, kmax = self._union("tile", mask, Lq, Lk, kmax)
        idx, cnt = _lists_from_mask(mask, kmax)
        out = tile_sparse(q, k, v, idx, cnt, softmax_scale=scale, causal=causal, trusted=True)
        return out, ("tile", mask), None

    def _queries(self, q, k, v, scale, causal, mask, kmax, schedule="kv_centric"):
        Lq, Lk = q.shape[1], k.shape[1]
        mask, kmax = self._union("query", mask, Lq, Lk, kmax)
        idx, _ = _lists_from_mask(mask, kmax)
        if self.method == "auto":
            shape = problem_shape(q, k, causal=causal)
            schedule = plan_schedule(idx, shape)["schedule"]
            if schedule == "q_centric":  # every query of a tile attends to the union of the tile's lists
                tiles = query_lists_to_tile_lists(idx, shape, trusted=True)
                out = tile_sparse(q, k, v, *tiles, softmax_scale=scale, causal=causal, trusted=True)
                pad = _cdiv(Lq, TILE_Q) * TILE_Q - Lq
                union = torch.nn.functional.pad(mask, (0, 0, 0, pad)).unflatten(2, (-1, TILE_Q)).any(3)
                return out, ("tile", union), schedule
        out = query_sparse(q, k, v, idx, softmax_scale=scale, causal=causal, trusted=True, schedule=schedule)
        return out, ("query", mask), schedule if self.method == "auto" else None

    def _index_vectors(self, module, q, k):
        if self.indexer is not None:
            return self.indexer(module, q, k)
        B, Lq, Hq, D = q.shape
        Hkv = k.shape[2]
        return q.view(B, Lq, Hkv, Hq // Hkv, D).mean(3), k

    def __call__(self, module, q, k, v, scale, causal):
        m = self.method
        B, Lq, Hq, D = q.shape
        Lk, Hkv = k.shape[1], k.shape[2]
        Tk = _cdiv(Lk, BLOCK_K)
        top = min(self.blocks(Lk), Tk)
        if m == "dense":
            return dense(q, k, v, softmax_scale=scale, causal=causal), None, None
        if m == "pooled":
            ask = self._ask(top, 1, 1)
            idx, cnt = pooled_select(q, k, top_k=ask, representatives=self.representatives,
                                     force_local=self.local > 0, force_block0=self.sink > 0, causal=causal)
            return self._tiles(q, k, v, scale, causal, _mask_from_lists(idx, Tk, cnt), ask)
        if m in ("token_max", "auto"):
            qidx, kidx = self._index_vectors(module, q, k)
            ask = self._ask(top, 1, 1)  # the selector forces block 0 and the local block itself
            sink = self.sink > 0
            if m == "token_max" and self.granularity == "tile":
                idx, cnt = token_max_select(qidx, kidx, top_k=ask, precision=self.precision, causal=causal,
                                            reserve_local=self.local > 0, force_block0=sink, format="tile")
                return self._tiles(q, k, v, scale, causal, _mask_from_lists(idx, Tk, cnt), ask)
            idx = token_max_select(qidx, kidx, top_k=ask, precision=self.precision, causal=causal,
                                   reserve_local=self.local > 0, force_block0=sink, format="query")
            return self._queries(q, k, v, scale, causal, _mask_from_lists(idx, Tk), ask)
        if m == "lightning":
            blocks = self.lightning_format == "block"
            ask = self._ask(top, self.sink, 0)  # the selector keeps the sink blocks' keys itself
            top_k = ask if blocks else min(ask * BLOCK_K, Lk)
            fmt = "query" if blocks else "token"
            sink_keys = self.sink * BLOCK_K
            if self.indexer is not None:
                qI, w, kI = self.indexer(module, q, k)
                idx = lightning_select(qI, w, kI, top_k=top_k, causal=causal, precision=self.precision,
                                       groups=Hkv, format=fmt, sink_keys=sink_keys)
            else:
                G = Hq // Hkv
                w = torch.full((B, Lq, G), 1.0 / G, dtype=torch.float32, device=q.device)
                idx = torch.cat([lightning_select(q[:, :, g * G:(g + 1) * G], w, k[:, :, g], top_k=top_k,
                                                  causal=causal, precision=self.precision, format=fmt,
                                                  sink_keys=sink_keys)
                                 for g in range(Hkv)], dim=1)
            if blocks:
                return self._queries(q, k, v, scale, causal, _mask_from_lists(idx, Tk), ask)
            mask, kmax = self._union("token", _mask_from_lists(idx, Lk), Lq, Lk, top_k)
            idx, _ = _lists_from_mask(mask, kmax)
            out = token_sparse(q, k, v, idx, softmax_scale=scale, causal=causal, trusted=True)
            return out, ("token", mask), None
        if m == "gated":
            if not causal or Lq != Lk:
                raise Error(f"{_OP}: method 'gated': needs causal attention with Lq == Lk, got causal={causal}, "
                            f"Lq={Lq}, Lk={Lk}")
            thresholds = self._thresholds(module, Hq, top, q.device)
            out, _ = gated(q, k, v, thresholds, softmax_scale=scale, sink_blocks=self.table["sink_blocks"],
                           stats=False)
            return out, ("gated", thresholds), None
        if m == "entmax":
            out, bits = entmax(q, k, v, alpha=self.alpha, softmax_scale=scale, causal=causal,
                               return_block_bits=True)
            return out, ("tile", _bits_mask(bits, Tk)), None
        # oracle: the forced blocks count towards its budget like the selectors' own
        forced = _forced("tile", Lq, Lk, self.sink, self.local, q.device)
        return self._tiles(q, k, v, scale, causal, _oracle_mask(q, k, scale, causal, top, forced), top)

    def _thresholds(self, module, Hq, budget, device):
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise Error(f"{_OP}: method 'gated': the attention module has no layer_idx")
        key = (layer, budget, device)
        if key not in self._slices:
            values, budgets = self.table["values"], self.table["budgets"]
            _, n_layers, n_heads, _ = values.shape
            if n_heads != Hq or not 0 <= layer < n_layers:
                raise Error(f"{_OP}: argument 'thresholds': the table has {n_layers} layers x {n_heads} heads "
                            f"(model '{self.table['model']}'); layer {layer} has {Hq} query heads")
            # The diagonal block and the table's sinks are always kept and count towards the budget.
            off_diagonal = max(1, budget - 1 - self.table["sink_blocks"])
            if off_diagonal not in budgets:
                raise Error(f"{_OP}: argument 'budget': {budget} blocks needs the table's slice for budget "
                            f"{off_diagonal}; the table has no slice for budget {off_diagonal} (budgets: {budgets})")
            self._slices[key] = torch.as_tensor(values[budgets.index(off_diagonal), layer], device=device)
        return self._slices[key]


def _oracle_mask(q, k, scale, causal, top, forced=None):
    """bool [B, Hkv, Tq, Tk]: the top blocks of each Q tile by dense softmax mass, summed over the
    tile's queries and the group's heads (float32, torch); `forced` blocks (bool [Tq, Tk]) first."""
    B, Lq, Hq, _ = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    s = torch.einsum("bqhgd,bkhd->bhgqk", q.float().view(B, Lq, Hkv, Hq // Hkv, -1), k.float()) * scale
    if causal:
        vis = torch.arange(Lk, device=q.device)[None, :] <= torch.arange(Lq, device=q.device)[:, None] + Lk - Lq
        s = s.masked_fill(~vis, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0).sum(2)  # [B, Hkv, Lq, Lk]
    Tq, Tk = _cdiv(Lq, TILE_Q), _cdiv(Lk, BLOCK_K)
    p = torch.nn.functional.pad(p, (0, Tk * BLOCK_K - Lk, 0, Tq * TILE_Q - Lq))
    mass = p.view(B, Hkv, Tq, TILE_Q, Tk, BLOCK_K).sum(dim=(3, 5))
    useful = mass > 0
    if forced is not None:
        useful |= forced
        mass = mass.masked_fill(forced, math.inf)
    chosen = torch.topk(mass, min(top, Tk), dim=-1).indices
    mask = torch.zeros_like(mass, dtype=torch.bool).scatter_(-1, chosen, True)
    return mask & useful


# ---- the transformers attention function ---------------------------------------------------------

def make_hf_attention(method: Optional[str] = None, *, budget=16, sink_blocks: int = 1, local_blocks: int = 1,
                      min_length: int = 0, representatives: int = 1, granularity: str = "tile", thresholds=None,
                      alpha: float = 1.5, indexer: Optional[Callable] = None, precision: str = "bf16",
                      lightning_format: str = "token", recorder: Optional[Recorder] = None,
                      observer: Optional[Callable] = None, mode: Optional[str] = None, top_k=None):
    """An attention function with the transformers AttentionInterface signature running `method`
    (see the module documentation for methods and options). mode= and top_k= are the earlier
    spellings of method= and budget= (mode accepts "dense" and "pooled")."""
    if mode is not None:
        if method is not None:
            raise Error("register_hf_attention: give 'method' or its earlier spelling 'mode', not both")
        if mode not in ("dense", "pooled"):
            raise Error(f"register_hf_attention: argument 'mode': expected 'dense' or 'pooled', got {mode!r}")
        method = mode
    if top_k is not None:
        budget = top_k
    impl = _Method(method or "dense", budget, sink_blocks, local_blocks, representatives, granularity, thresholds,
                   alpha, indexer, precision, lightning_format)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if dropout:
            raise Error(f"{_OP}: argument 'dropout': must be 0 for inference, got {dropout}")
        if kwargs.get("sliding_window") is not None:
            raise Error(f"{_OP}: argument 'sliding_window': sliding-window layers are not supported")
        if attention_mask is not None:
            raise Error(f"{_OP}: argument 'attention_mask': padded batches are not supported "
                        "(the kernels apply only the causal rule)")
        causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
        # (B, H, L, D) -> (B, L, H, D) views: strides are free as long as D is contiguous.
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
        if observer is not None:
            observer(module, q, k, v, scale)
        Lq, Lk = q.shape[1], k.shape[1]
        if Lq == 1 or Lk < max(min_length, 1):
            out, sel, schedule = dense(q, k, v, softmax_scale=scale, causal=causal), None, None
        else:
            out, sel, schedule = impl(module, q, k, v, scale, causal)
        if recorder is not None:
            layer = getattr(module, "layer_idx", id(module))
            pairs = None
            if sel is not None:
                grid, mask = sel
                if grid == "gated":
                    grid, mask = "gate", _gate_mask(q, k, mask, scale, impl.table["sink_blocks"])
                pairs = _pairs(grid, mask, Lq, Lk)
            with torch.no_grad():
                recorder.record(layer, q, k, scale, causal, pairs)
            if schedule is not None:
                recorder.schedules[schedule] = recorder.schedules.get(schedule, 0) + 1
        return out, None

    return attention


def _padding_mask(*args, attention_mask=None, kv_length=None, **kwargs):
    """AttentionMaskInterface entry: the kernels apply the causal rule themselves, so no 4-d mask is
    built; a 2-d padding mask is passed on only when it pads something (the attention function
    then refuses it rather than attending to padding). Keyword-only on purpose: the arguments
    transformers passes differ between releases (cache_position, q_length, q_offset, ...)."""
    if attention_mask is None:
        return None
    if kv_length is not None:
        attention_mask = attention_mask[:, -kv_length:]
    return None if bool(attention_mask.all()) else attention_mask


def register_hf_attention(name="sparse_attn", method: Optional[str] = None, **options):
    """Registers `name` with transformers' AttentionInterface (make_hf_attention(method, **options))
    and AttentionMaskInterface (without a mask entry transformers would build no causal mask for an
    unknown implementation). Returns False when transformers is not importable. Use with
    ``AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)``."""
    function = make_hf_attention(method, **options)
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(name, function)
    try:
        from transformers import AttentionMaskInterface
    except ImportError:
        from transformers.masking_utils import AttentionMaskInterface
    AttentionMaskInterface.register(name, _padding_mask)
    return True
