"""Context-parallel prefill over torch.distributed: ``dense``, ``tile_sparse`` and ``query_sparse``
with the sequence sharded across the ranks of a process group (docs/design.md §5.10).

Each rank holds the q, k and v rows of its own 128-token tiles (Lq = Lk: self-attention prefill). The
same code runs on gloo with CPU tensors and on NCCL with CUDA tensors: every transfer is one
``all_to_all_single`` issued with ``async_op=True`` (NCCL runs it on its own stream, gloo on its own
thread), and the attention that does not depend on it runs on the caller's stream meanwhile.

Usage, the same on every rank (the selection is global and every rank passes the same one)::

    shape = sparse_attn.ProblemShape(B, L, L, Hq, Hkv, D, True)
    plan = distributed.plan(shape, world_size, dtype=torch.bfloat16, tiles=(idx, cnt))
    q_local, k_local, v_local = (plan.shard(x, rank) for x in (q, k, v))   # or computed locally
    out_local, lse_local = distributed.tile_sparse(q_local, k_local, v_local, idx, cnt, plan,
                                                   return_lse=True)

**Layout.** Tiles are cut into chunks of ``chunk_tiles`` tiles; chunk c is paired with chunk
``n - 1 - c`` (zig-zag), so that under a causal mask every pair holds about the same work. Each rank
gets an equal number of pairs. Which pairs go where is chosen from the selection: the work of a tile
is its selected, visible (query row, query head, key block) visits; the planner compares the plain
zig-zag (rank r takes the r-th run of pairs) with a longest-processing-time assignment of the pairs
(heaviest first, to the least-loaded rank with room) and keeps the LPT one only when its largest
per-rank work is smaller. ``Plan.balance`` is max / mean of the per-rank work.

**Strategies.** ``kv``: every rank receives the K/V blocks of other ranks that its own tiles select
(one (batch, KV head, block) at a time, each sent once per receiving rank) and runs the operator on its
own rows. The executors compute every row from its own list of blocks in list order (docs/design.md
§5.2, §5.3), so the result is bitwise the single-process result for those rows. ``partials``: every
rank sends the q rows of each of its tiles to each rank holding a block that tile selects, that rank
computes the tile's partial output and LSE over its own blocks and sends them back, and the partials
are merged in rank order 0 .. R-1 (below). The planner counts the bytes of both exactly from the lists
and picks the smaller total (``kv`` on a tie); ``strategy=`` forces one.

**Bytes** (what the collectives carry; the last, partial block or tile travels padded to 128 rows):
``kv``: 2 · 128 · D · itemsize per (batch, KV head, block) a rank receives;
``partials``: B · 128 · Hq · D · itemsize of q per (tile, other rank) pair, and B · 128 · Hq ·
(D · itemsize + 4) of partial output (q's dtype, the executors' output) and float32 LSE back.

**Merge.** The library's combine of partials with their LSE is internal to ``query_sparse``'s
KV-centric executor (per-slot partials of one call, src/attention/cpu_query_sparse.cpp) and has no
Python binding, so the merge here is a small torch implementation of the same arithmetic, in float32:
``m = max_s lse_s``; ``lse = m + log Σ_s exp(lse_s − m)``; ``out = Σ_s exp(lse_s − lse) · out_s``,
skipping partials with ``lse_s = -inf``; a NaN partial LSE makes the row NaN; no partial at all gives
``out = 0, lse = -inf``. Both sums run over the ranks in the fixed order 0 .. R-1, whatever order the
partials arrived in, so the result is the same on every run.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch
import torch.distributed as dist

import sparse_attn as _sa

TILE = _sa.TILE_Q
if _sa.BLOCK_K != TILE:  # tiles and blocks share one index below
    raise ImportError(f"sparse_attn.distributed needs BLOCK_K == TILE_Q, got {_sa.BLOCK_K} and {TILE}")

STRATEGIES = ("kv", "partials")

__all__ = ["Plan", "Traffic", "STRATEGIES", "plan", "dense", "tile_sparse", "query_sparse", "gather"]


def _ceil_div(a, b):
    return -(-a // b)


# ---- the selection on the host -------------------------------------------------------------------

def _host(x):
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.int32)


def _fingerprint(kind, shape, arrays):
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{kind} {shape.describe()}".encode())
    for a in arrays:
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class _Selection:
    """A selection as the planner and the runs read it: host copies of its lists, ``need`` (bool
    [B, G, Tq, Tk]: block j is selected by tile t and visible to some row of it) and the work of each
    tile."""
    kind: str            # "dense", "tiles" or "query"
    fingerprint: str
    need: np.ndarray
    work: np.ndarray     # int64 [Tq]
    idx: np.ndarray | None = None
    cnt: np.ndarray | None = None
    given: tuple = ()    # the caller's tensors and their torch version counters, for same()

    def same(self, kind, shape, arrays):
        """Whether `arrays` (the selection an operator got) is the one this was made from: the same
        tensor objects unmodified since (no copy, no hash), else the same contents."""
        if kind != self.kind:
            return False
        if len(arrays) == len(self.given) and all(
                a is g and v is not None and _version(a) == v for a, (g, v) in zip(arrays, self.given)):
            return True
        return _fingerprint(kind, shape, tuple(_host(a) for a in arrays)) == self.fingerprint


def _version(a):
    """A tensor's version counter (bumped by every in-place change); None for anything else and for
    inference-mode tensors, which keep none."""
    try:
        return a._version if isinstance(a, torch.Tensor) else None
    except RuntimeError:
        return None


def _given(*arrays):
    return tuple((a, _version(a)) for a in arrays)


def _selection(op, shape, tiles, query_lists):
    B, L, Hq, Hkv, T = shape.B, shape.Lq, shape.Hq, shape.Hkv, shape.Tq
    rows = np.minimum(TILE, L - TILE * np.arange(T)).astype(np.int64)
    # Block j is visible to some row of tile t iff j <= t (causal, Lq == Lk); the same holds for each
    # single query of tile t, whose first visible key of block t is key 128 t itself.
    visible = np.tri(T, dtype=bool) if shape.causal else np.ones((T, T), dtype=bool)
    if tiles is not None and query_lists is not None:
        raise _sa.Error(f"{op}: argument 'selection': give at most one of tiles, query_lists")
    if tiles is None and query_lists is None:
        need = np.broadcast_to(visible, (B, Hkv, T, T))
        work = rows * Hq * B * visible.sum(1)
        return _Selection("dense", _fingerprint("dense", shape, ()), need, work)
    if tiles is not None:
        if not isinstance(tiles, (tuple, list)) or len(tiles) != 2:
            raise _sa.Error(f"{op}: argument 'tiles': expected a pair (idx, cnt)")
        idx, cnt = _host(tiles[0]), _host(tiles[1])
        _sa.validate(shape, tiles=(idx, cnt), op=op)
        G = idx.shape[1]
        b, g, t, s = np.nonzero(np.arange(idx.shape[3]) < cnt[..., None])
        need = np.zeros((B, G, T, T), dtype=bool)
        need[b, g, t, idx[b, g, t, s]] = True
        need &= visible
        work = rows * (Hq // G) * need.sum(axis=(0, 1, 3))
        return _Selection("tiles", _fingerprint("tiles", shape, (idx, cnt)), need, work, idx, cnt,
                          _given(*tiles))
    idx = _host(query_lists)
    _sa.validate(shape, query_lists=idx, op=op)
    tile_of = np.arange(L) // TILE
    valid = idx >= 0
    if shape.causal:
        valid &= idx <= tile_of[:, None]
    b, g, i, s = np.nonzero(valid)
    need = np.zeros((B, Hkv, T, T), dtype=bool)
    need[b, g, tile_of[i], idx[b, g, i, s]] = True
    work = (Hq // Hkv) * np.bincount(tile_of[i], minlength=T).astype(np.int64)
    return _Selection("query", _fingerprint("query", shape, (idx,)), need, work, idx, None, _given(query_lists))


# ---- the partition of tiles over ranks -----------------------------------------------------------

def _units(T, chunk):
    """Zig-zag units: chunk c together with chunk n - 1 - c (the middle chunk alone when n is odd)."""
    chunks = [list(range(c * chunk, min(T, (c + 1) * chunk))) for c in range(_ceil_div(T, chunk))]
    n = len(chunks)
    return [chunks[c] + chunks[n - 1 - c] for c in range(n // 2)] + ([chunks[n // 2]] if n % 2 else [])


def _partition(work, R, chunk):
    """(tiles per rank, layout name): an equal number of zig-zag units per rank (the first
    U mod R ranks one more), by plain zig-zag or by LPT on the units' work, whichever has the smaller
    largest per-rank work (zig-zag on a tie: its ranks hold fewer, longer runs of tiles)."""
    units = _units(len(work), chunk)
    U = len(units)
    cap = [U // R + (r < U % R) for r in range(R)]
    uwork = [int(work[u].sum()) for u in units]

    zigzag, first = [], 0
    for r in range(R):
        zigzag.append(list(range(first, first + cap[r])))
        first += cap[r]

    lpt, load = [[] for _ in range(R)], [0] * R
    for u in sorted(range(U), key=lambda u: (-uwork[u], u)):
        r = min((r for r in range(R) if len(lpt[r]) < cap[r]), key=lambda r: (load[r], r))
        lpt[r].append(u)
        load[r] += uwork[u]

    def peak(assign):
        return max(sum(uwork[u] for u in a) for a in assign)

    assign, layout = (lpt, "balanced") if peak(lpt) < peak(zigzag) else (zigzag, "zigzag")
    return [sorted(t for u in a for t in units[u]) for a in assign], layout


# ---- the plan ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes one strategy moves: ``matrix[src][dst]`` from rank src to rank dst, ``sent`` and
    ``received`` per rank and their ``total``."""
    matrix: tuple
    sent: tuple
    received: tuple
    total: int

    @staticmethod
    def of(matrix):
        m = np.asarray(matrix, dtype=np.int64)
        return Traffic(tuple(tuple(int(x) for x in row) for row in m), tuple(int(x) for x in m.sum(1)),
                       tuple(int(x) for x in m.sum(0)), int(m.sum()))


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Where each tile lives, what each strategy moves and which one runs (see the module text).

    ``tiles[r]``: the global tile ids of rank r, ascending; its local rows are those tiles' rows in
    that order. ``work[r]``: the selected visible (query row, query head, key block) visits of rank r;
    ``balance = max(work) / mean(work)``. ``traffic[s]``: the bytes of strategy s; ``strategy`` the one
    the operators run."""
    shape: object
    world_size: int
    kind: str
    itemsize: int
    chunk_tiles: int
    layout: str
    tiles: tuple
    work: tuple
    balance: float
    traffic: dict
    strategy: str
    # What the runs read: the owner of each tile / block, the (batch, KV head, block) triples each rank
    # sends each other rank under "kv", the tiles each rank sends each other rank under "partials",
    # whether a tile selects a block of another rank, and the selection itself.
    _owner: np.ndarray = dataclasses.field(repr=False)
    _kv_send: tuple = dataclasses.field(repr=False)
    _q_send: tuple = dataclasses.field(repr=False)
    _remote: np.ndarray = dataclasses.field(repr=False)
    _selection: _Selection = dataclasses.field(repr=False)
    # The lists of each run, each rank's row positions and the exchanges' indices on their device, made
    # by the first call that needs them (a plan is made once and run many times, as query_sparse_plan /
    # query_sparse_run are). See _cached.
    _device_cache: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def causal(self):
        return bool(self.shape.causal)

    def rows(self, rank, device="cpu"):
        """The global sequence positions of rank's local rows (int64 tensor on device, ascending)."""
        rows = (np.asarray(self.tiles[rank], dtype=np.int64)[:, None] * TILE + np.arange(TILE)).ravel()
        return self._cached(("rows", rank), device, lambda: (rows[rows < self.shape.Lq],))[0]

    def _cached(self, key, device, make):
        """The tensors of make() (numpy arrays) on device, made once per plan, key and device."""
        key = key + (torch.device(device),)
        if key not in self._device_cache:
            self._device_cache[key] = tuple(torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in make())
        return self._device_cache[key]

    def shard(self, x, rank, dim=1):
        """Rank's rows of a tensor holding the whole sequence along dim (q, k, v: dim 1; lse: dim 2)."""
        return x.index_select(dim, self.rows(rank, x.device))

    def unshard(self, parts, dim=1):
        """The whole sequence from every rank's local rows (the inverse of shard)."""
        cat = torch.cat(list(parts), dim=dim)
        rows = torch.cat([self.rows(r, cat.device) for r in range(self.world_size)])
        return torch.empty_like(cat).index_copy_(dim, rows, cat)

    def summary(self):
        """A dict of plain numbers for a report: layout, strategy, work, balance, bytes per rank."""
        return {"world_size": self.world_size, "kind": self.kind, "layout": self.layout,
                "chunk_tiles": self.chunk_tiles, "strategy": self.strategy, "work": list(self.work),
                "balance": self.balance,
                **{f"{s}_bytes_sent": list(self.traffic[s].sent) for s in STRATEGIES},
                **{f"{s}_bytes_received": list(self.traffic[s].received) for s in STRATEGIES},
                **{f"{s}_bytes_total": self.traffic[s].total for s in STRATEGIES}}


def plan(shape, world_size, *, dtype, tiles=None, query_lists=None, strategy="auto", chunk_tiles=None):
    """The context-parallel plan of one selection (none: dense) on ``world_size`` ranks. Every rank
    computes the same plan from the same arguments; nothing is communicated.

    shape: the global ``ProblemShape`` (Lq == Lk). dtype: the torch dtype of q, k and v (for the byte
    counts). tiles=(idx, cnt) or query_lists=idx: the global selection, validated here. strategy:
    "auto" (fewer bytes), "kv" or "partials". chunk_tiles: tiles per zig-zag chunk; default
    max(1, Tq // (16 · world_size)), about eight chunk pairs per rank."""
    op = "distributed.plan"
    if not isinstance(shape, _sa.ProblemShape):
        raise TypeError(f"{op}: argument 'shape': expected sparse_attn.ProblemShape, got {type(shape).__name__}")
    if shape.Lq != shape.Lk:
        raise _sa.Error(f"{op}: argument 'shape': context parallelism shards one sequence, needs Lq == Lk, "
                        f"got Lq = {shape.Lq}, Lk = {shape.Lk}")
    R = _sa._int(op, "world_size", world_size, 1)
    if strategy not in ("auto",) + STRATEGIES:
        raise _sa.Error(f"{op}: argument 'strategy': expected 'auto', 'kv' or 'partials', got {strategy!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{op}: argument 'dtype': expected a torch.dtype, got {type(dtype).__name__}")
    T = shape.Tq
    chunk = max(1, T // (16 * R)) if chunk_tiles is None else _sa._int(op, "chunk_tiles", chunk_tiles, 1)
    sel = _selection(op, shape, tiles, query_lists)

    tiles_of, layout = _partition(sel.work, R, chunk)
    owner = np.empty(T, dtype=np.int64)
    for r, ts in enumerate(tiles_of):
        owner[ts] = r
    work = [int(sel.work[ts].sum()) for ts in tiles_of]
    mean = sum(work) / R
    balance = max(work) / mean if mean > 0 else 1.0

    B, Hq, Hkv, D = shape.B, shape.Hq, shape.Hkv, shape.D
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = sel.need
    need_kv = need.reshape(B, Hkv, need.shape[1] // Hkv, T, T).any(axis=2)  # [B, Hkv, Tq, Tk]
    tile_need = need.any(axis=(0, 1))                                        # [Tq, Tk]
    remote = (tile_need & (owner[None, :] != owner[:, None])).any(axis=1)    # [Tq]

    kv_send = [[None] * R for _ in range(R)]  # [src][dst]: int64 [n, 3] (b, hkv, block)
    q_send = [[None] * R for _ in range(R)]   # [src][dst]: global tile ids of src, ascending
    kv_bytes = np.zeros((R, R), dtype=np.int64)
    q_bytes = np.zeros((R, R), dtype=np.int64)
    per_block = 2 * TILE * D * itemsize
    per_q_tile = B * TILE * Hq * D * itemsize
    per_partial_tile = B * TILE * Hq * (D * itemsize + 4)
    for dst in range(R):
        wanted = need_kv[:, :, owner == dst].any(axis=2)  # [B, Hkv, Tk]
        for src in range(R):
            if src == dst:
                kv_send[src][dst] = np.zeros((0, 3), dtype=np.int64)
                q_send[src][dst] = []
                continue
            from_src = wanted & (owner == src)
            kv_send[src][dst] = np.argwhere(from_src)
            kv_bytes[src, dst] = len(kv_send[src][dst]) * per_block
            # Tiles of dst that select a visible block of src: their q goes dst -> src.
            ts = [int(t) for t in tiles_of[dst] if tile_need[t, owner == src].any()]
            q_send[dst][src] = ts
            q_bytes[dst, src] += len(ts) * per_q_tile
            q_bytes[src, dst] += len(ts) * per_partial_tile
    traffic = {"kv": Traffic.of(kv_bytes), "partials": Traffic.of(q_bytes)}
    if strategy == "auto":
        strategy = "partials" if traffic["partials"].total < traffic["kv"].total else "kv"
    return Plan(shape, R, sel.kind, itemsize, chunk, layout, tuple(tuple(t) for t in tiles_of), tuple(work),
                balance, traffic, strategy, owner, tuple(tuple(row) for row in kv_send),
                tuple(tuple(row) for row in q_send), remote, sel)


# ---- the runs ------------------------------------------------------------------------------------

def _runs(tiles):
    """Maximal runs of consecutive tile ids: [(t0, t1)] with tiles t0 .. t1 - 1."""
    runs = []
    for t in tiles:
        if runs and runs[-1][1] == t:
            runs[-1][1] = t + 1
        else:
            runs.append([t, t + 1])
    return [tuple(r) for r in runs]


class _Executor:
    """The operator on one run of consecutive tiles t0 .. t1 - 1 (global rows start .. end - 1) against
    K/V buffers of the whole sequence in global positions. Under a causal mask the keys are cut at
    `end`: with the bottom-right alignment of docs/design.md §2, row i of the run then sees key j iff
    j <= start + i, its global position. `only` (a rank or None) restricts the blocks to that rank's;
    ids a causal run cannot see (at or past its end) are dropped, as the executors skip them."""

    def __init__(self, plan, scale, partials):
        self.plan, self.scale, self.partials = plan, scale, partials
        self.calls = 0

    def __call__(self, q, kbuf, vbuf, t0, t1, only=None):
        shape = self.plan.shape
        kend = min(shape.Lq, t1 * TILE) if shape.causal else shape.Lq
        k, v = kbuf[:, :kend], vbuf[:, :kend]
        args = dict(softmax_scale=self.scale, causal=shape.causal, return_lse=True)
        self.calls += 1
        if self.plan.kind == "dense" and only is None:
            return _sa.dense(q, k, v, **args)
        lists = self.plan._cached(("run", t0, t1, only), q.device,
                                  lambda: self._lists(t0, t1, _ceil_div(kend, TILE), only))
        if self.plan.kind == "query":
            return _sa.query_sparse(q, k, v, *lists, partials=self.partials, trusted=True, **args)
        return _sa.tile_sparse(q, k, v, *lists, trusted=True, **args)

    def _lists(self, t0, t1, tk, only):
        """The run's lists (numpy): the selection's rows of the run without ids >= tk and, with
        `only`, without other ranks' blocks."""
        plan, sel = self.plan, self.plan._selection
        allowed = np.arange(plan.shape.Tk) < tk
        if only is not None:
            allowed &= plan._owner == only
        if sel.kind == "query":
            idx = sel.idx[:, :, t0 * TILE:min(plan.shape.Lq, t1 * TILE)].copy()
            idx[(idx >= 0) & ~allowed[np.clip(idx, 0, None)]] = -1
            return (idx,)
        if sel.kind == "dense":
            blocks = np.flatnonzero(allowed).astype(np.int32)
            idx = np.broadcast_to(blocks, (plan.shape.B, plan.shape.Hkv, t1 - t0, len(blocks)))
            cnt = np.full(idx.shape[:3], len(blocks), dtype=np.int32)
        else:
            idx, cnt = sel.idx[:, :, t0:t1], sel.cnt[:, :, t0:t1]
            keep = (np.arange(idx.shape[3]) < cnt[..., None]) & allowed[np.clip(idx, 0, len(allowed) - 1)]
            # The kept ids of each list, still ascending, moved to its front.
            idx = np.take_along_axis(idx, np.argsort(~keep, axis=-1, kind="stable"), axis=-1)
            cnt = keep.sum(axis=-1, dtype=np.int32)
        if idx.shape[3] == 0:
            idx = np.full(idx.shape[:3] + (1,), -1, dtype=np.int32)
        return idx, cnt


def _rank_of(group):
    if not dist.is_available() or not dist.is_initialized():
        raise _sa.Error("distributed: torch.distributed is not initialised (call init_process_group first)")
    return dist.get_rank(group), dist.get_world_size(group)


def _check(op, plan, q, k, v, rank, world):
    if not isinstance(plan, Plan):
        raise TypeError(f"{op}: argument 'plan': expected sparse_attn.distributed.Plan, got {type(plan).__name__}")
    if world != plan.world_size:
        raise _sa.Error(f"{op}: argument 'plan': made for {plan.world_size} ranks, the group has {world}")
    s = plan.shape
    n = int(sum(min(TILE, s.Lq - t * TILE) for t in plan.tiles[rank]))
    for name, x, heads in (("q", q, s.Hq), ("k", k, s.Hkv), ("v", v, s.Hkv)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: argument '{name}': expected a torch.Tensor, got {type(x).__name__}")
        want = (s.B, n, heads, s.D)
        if tuple(x.shape) != want:
            raise _sa.Error(f"{op}: argument '{name}': rank {rank} holds {len(plan.tiles[rank])} tiles, expected "
                            f"shape {list(want)}, got {list(x.shape)}")
        if x.dtype != q.dtype or x.device != q.device:
            raise _sa.Error(f"{op}: argument '{name}': expected q's dtype and device ({q.dtype}, {q.device}), "
                            f"got {x.dtype}, {x.device}")
    itemsize = q.element_size()
    if itemsize != plan.itemsize:
        raise _sa.Error(f"{op}: argument 'q': the plan counted {plan.itemsize}-byte elements, q has {itemsize}")


def _full_length(plan, local, rank):
    """A [B, Tk · 128, H, D] buffer of the whole sequence holding rank's rows of `local` in their global
    positions and NaN everywhere else (a block read without being received shows as NaN)."""
    s = plan.shape
    buf = torch.full((s.B, s.Tk * TILE) + tuple(local.shape[2:]), float("nan"), dtype=local.dtype,
                     device=local.device)
    return buf.index_copy_(1, plan.rows(rank, local.device), local)


def _blocks(buf):
    """[B, Tk, 128, H, D] view of a full-length buffer."""
    B, Lpad, H, D = buf.shape
    return buf.view(B, Lpad // TILE, TILE, H, D)


def _exchange(recv, send, recv_rows, send_rows, group):
    """One all_to_all_single of row-major tensors as bytes (any dtype), asynchronous."""
    return dist.all_to_all_single(recv.view(torch.uint8), send.view(torch.uint8), recv_rows, send_rows, group=group,
                                  async_op=True)


def _kv_exchange(plan, rank, group, q, k, v, run):
    R, dev = plan.world_size, q.device
    kbuf, vbuf = _full_length(plan, k, rank), _full_length(plan, v, rank)
    kb, vb = _blocks(kbuf), _blocks(vbuf)

    def triples(name, sets):
        return plan._cached((name, rank), dev, lambda: np.concatenate(sets).T)

    out_sets = [plan._kv_send[rank][dst] for dst in range(R)]
    in_sets = [plan._kv_send[src][rank] for src in range(R)]
    b, h, j = triples("kv_out", out_sets)
    send = torch.stack((kb[b, j, :, h, :], vb[b, j, :, h, :]), dim=1).contiguous()  # [n, 2, 128, D]
    recv = torch.empty((sum(len(s) for s in in_sets),) + tuple(send.shape[1:]), dtype=send.dtype, device=dev)
    work = _exchange(recv, send, [len(s) for s in in_sets], [len(s) for s in out_sets], group)

    s = plan.shape
    n = q.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((s.B, s.Hq, n), dtype=torch.float32, device=dev)
    runs, first = [], 0
    for t0, t1 in _runs(plan.tiles[rank]):
        # Split where a run goes from tiles that need nothing remote to tiles that do.
        cut = t0
        for t in range(t0 + 1, t1 + 1):
            if t == t1 or plan._remote[t] != plan._remote[cut]:
                rows = min(s.Lq, t * TILE) - cut * TILE
                runs.append((cut, t, first, rows, bool(plan._remote[cut])))
                first += rows
                cut = t

    def compute(t0, t1, first, rows):
        o, l = run(q[:, first:first + rows], kbuf, vbuf, t0, t1)
        out[:, first:first + rows] = o
        lse[:, :, first:first + rows] = l

    for t0, t1, first, rows, remote in runs:  # overlaps the exchange
        if not remote:
            compute(t0, t1, first, rows)
    work.wait()
    b, h, j = triples("kv_in", in_sets)
    kb[b, j, :, h, :] = recv[:, 0]
    vb[b, j, :, h, :] = recv[:, 1]
    for t0, t1, first, rows, remote in runs:
        if remote:
            compute(t0, t1, first, rows)
    return out, lse, send.numel() * send.element_size(), recv.numel() * recv.element_size()


def _merge(plan, rank, own, received):
    """out, lse of rank's rows from its own partial and the received ones (module text: Merge).
    own: (out [B, n, Hq, D], lse [B, Hq, n]); received: per source rank, (local tile positions,
    out [m, B, 128, Hq, D], lse [m, B, Hq, 128]) or None."""
    s = plan.shape
    o_own, l_own = own
    B, n, Hq, D = o_own.shape
    ntiles = len(plan.tiles[rank])
    npad = ntiles * TILE
    lse_all = torch.full((plan.world_size, B, Hq, npad), float("-inf"), dtype=torch.float32, device=o_own.device)
    lse_all[rank, :, :, :n] = l_own
    for src, part in enumerate(received):
        if part is not None:
            pos, _, l = part
            lse_all[src].view(B, Hq, ntiles, TILE)[:, :, pos] = l.permute(1, 2, 0, 3)
    nan = torch.isnan(lse_all).any(dim=0)
    m = lse_all.amax(dim=0)
    empty = m == float("-inf")
    m0 = torch.where(empty | nan, torch.zeros_like(m), m)
    total = torch.zeros_like(m)
    for src in range(plan.world_size):
        total += torch.exp(lse_all[src] - m0)
    lse = m0 + torch.log(total)
    lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse)
    lse = torch.where(nan, torch.full_like(lse, float("nan")), lse)
    lse0 = torch.where(empty | nan, torch.zeros_like(lse), lse)

    acc = torch.zeros((B, ntiles, TILE, Hq, D), dtype=torch.float32, device=o_own.device)
    flat = acc.view(B, npad, Hq, D)
    for src in range(plan.world_size):
        li = lse_all[src]
        # Weights [B, ntiles, 128, Hq, 1]; a partial with lse = -inf is skipped, not weighed by 0.
        w = torch.exp(li - lse0).permute(0, 2, 1).reshape(B, ntiles, TILE, Hq, 1)
        skip = (li == float("-inf")).permute(0, 2, 1).reshape(B, ntiles, TILE, Hq, 1)
        if src == rank:
            term = w.reshape(B, npad, Hq, 1)[:, :n] * o_own.float()
            flat[:, :n] += torch.where(skip.reshape(B, npad, Hq, 1)[:, :n], torch.zeros_like(term), term)
        elif received[src] is not None:
            pos, o, _ = received[src]
            term = w[:, pos] * o.permute(1, 0, 2, 3, 4).float()
            acc[:, pos] += torch.where(skip[:, pos], torch.zeros_like(term), term)
    out = flat[:, :n]
    out = torch.where(nan[:, :, :n].permute(0, 2, 1).unsqueeze(-1), torch.full_like(out, float("nan")), out)
    return out.to(o_own.dtype), lse[:, :, :n].contiguous()


def _partial_exchange(plan, rank, group, q, k, v, run):
    R, dev, s = plan.world_size, q.device, plan.shape
    B, n, Hq, D = q.shape
    kbuf, vbuf = _full_length(plan, k, rank), _full_length(plan, v, rank)
    local_pos = {t: i for i, t in enumerate(plan.tiles[rank])}
    ntiles = len(plan.tiles[rank])
    qpad = torch.zeros((B, ntiles * TILE, Hq, D), dtype=q.dtype, device=dev)
    qpad[:, :n] = q
    qt = qpad.view(B, ntiles, TILE, Hq, D)

    out_sets = [plan._q_send[rank][dst] for dst in range(R)]
    in_sets = [plan._q_send[src][rank] for src in range(R)]
    pos, = plan._cached(("q_out", rank), dev, lambda: (np.array([local_pos[t] for ts in out_sets for t in ts],
                                                                 dtype=np.int64),))
    send_q = qt[:, pos].permute(1, 0, 2, 3, 4).contiguous()  # [m, B, 128, Hq, D]
    m_in = sum(len(ts) for ts in in_sets)
    recv_q = torch.empty((m_in, B, TILE, Hq, D), dtype=q.dtype, device=dev)
    counts_out, counts_in = [len(ts) for ts in out_sets], [len(ts) for ts in in_sets]
    work = _exchange(recv_q, send_q, counts_in, counts_out, group)

    # Own rows over own blocks, while the q rows travel.
    o_own, l_own = torch.empty_like(q), torch.empty((B, Hq, n), dtype=torch.float32, device=dev)
    first = 0
    for t0, t1 in _runs(plan.tiles[rank]):
        rows = min(s.Lq, t1 * TILE) - t0 * TILE
        o, l = run(q[:, first:first + rows], kbuf, vbuf, t0, t1, rank)
        o_own[:, first:first + rows], l_own[:, :, first:first + rows] = o, l
        first += rows
    work.wait()

    # Other ranks' rows over own blocks, sent back in the order they came.
    send_o = torch.zeros((m_in, B, TILE, Hq, D), dtype=q.dtype, device=dev)
    send_l = torch.full((m_in, B, Hq, TILE), float("-inf"), dtype=torch.float32, device=dev)
    base = 0
    for src in range(R):
        ts = in_sets[src]
        i = 0
        for t0, t1 in _runs(ts):
            m, rows = t1 - t0, min(s.Lq, t1 * TILE) - t0 * TILE
            seg = slice(base + i, base + i + m)
            qr = recv_q[seg].permute(1, 0, 2, 3, 4).reshape(B, m * TILE, Hq, D)[:, :rows]
            o, l = run(qr, kbuf, vbuf, t0, t1, rank)
            send_o[seg] = _pad_rows(o, m * TILE).reshape(B, m, TILE, Hq, D).permute(1, 0, 2, 3, 4)
            send_l[seg] = _pad_rows(l.permute(0, 2, 1), m * TILE, float("-inf")).reshape(
                B, m, TILE, Hq).permute(1, 0, 3, 2)
            i += m
        base += len(ts)
    recv_o = torch.empty((sum(counts_out), B, TILE, Hq, D), dtype=q.dtype, device=dev)
    recv_l = torch.empty((sum(counts_out), B, Hq, TILE), dtype=torch.float32, device=dev)
    works = (_exchange(recv_o, send_o, counts_out, counts_in, group),
             _exchange(recv_l, send_l, counts_out, counts_in, group))
    for w in works:
        w.wait()

    received, base = [], 0
    for dst in range(R):
        ts = out_sets[dst]
        if ts:
            p, = plan._cached(("q_back", rank, dst), dev,
                              lambda: (np.array([local_pos[t] for t in ts], dtype=np.int64),))
            received.append((p, recv_o[base:base + len(ts)], recv_l[base:base + len(ts)]))
        else:
            received.append(None)
        base += len(ts)
    out, lse = _merge(plan, rank, (o_own, l_own), received)
    nbytes = lambda *xs: sum(x.numel() * x.element_size() for x in xs)  # noqa: E731
    return out, lse, nbytes(send_q, send_o, send_l), nbytes(recv_q, recv_o, recv_l)


def _pad_rows(x, rows, value=0.0):
    """x [B, r, ...] padded along dim 1 to `rows` rows of `value`."""
    if x.shape[1] == rows:
        return x
    pad = torch.full((x.shape[0], rows - x.shape[1]) + tuple(x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat((x, pad), dim=1)


def _run(op, kind, plan, q, k, v, selection, group, softmax_scale, partials, return_lse, return_stats):
    rank, world = _rank_of(group)
    _check(op, plan, q, k, v, rank, world)
    if not plan._selection.same(kind, plan.shape, selection):
        raise _sa.Error(f"{op}: argument 'plan': made for another selection (a {plan.kind} plan)")
    run = _Executor(plan, softmax_scale, partials)
    exchange = _kv_exchange if plan.strategy == "kv" else _partial_exchange
    out, lse, sent, received = exchange(plan, rank, group, q, k, v, run)
    result = (out, lse) if return_lse else (out,)
    if return_stats:
        result += ({"strategy": plan.strategy, "bytes_sent": sent, "bytes_received": received,
                    "calls": run.calls, "work": plan.work[rank]},)
    return result if len(result) > 1 else result[0]


def dense(q, k, v, plan, *, group=None, softmax_scale=None, return_lse=False, return_stats=False):
    """Dense attention of this rank's rows (q, k, v: [B, rows of plan.tiles[rank], H, D]) over the
    whole sequence; causal as the plan's shape. Returns out, then lse with return_lse, then a stats
    dict (strategy, bytes_sent, bytes_received as the collectives carried them, calls, work) with
    return_stats."""
    return _run("distributed.dense", "dense", plan, q, k, v, (), group, softmax_scale, "f32", return_lse,
                return_stats)


def tile_sparse(q, k, v, idx, cnt, plan, *, group=None, softmax_scale=None, return_lse=False,
                return_stats=False):
    """tile_sparse of this rank's rows over the global TileLists (idx, cnt) the plan was made from
    (every rank passes the same lists). Returns as ``dense``."""
    return _run("distributed.tile_sparse", "tiles", plan, q, k, v, (idx, cnt), group, softmax_scale, "f32",
                return_lse, return_stats)


def query_sparse(q, k, v, idx, plan, *, group=None, softmax_scale=None, partials="f32", return_lse=False,
                 return_stats=False):
    """query_sparse (KV-centric) of this rank's rows over the global QueryLists idx the plan was made
    from. partials: the executor's per-slot partial storage. Returns as ``dense``."""
    return _run("distributed.query_sparse", "query", plan, q, k, v, (idx,), group, softmax_scale, partials,
                return_lse, return_stats)


def gather(x, plan, *, group=None, dim=1):
    """The whole sequence on every rank from each rank's local rows along dim (all_gather; the
    shards are padded to the longest one for the collective)."""
    rank, world = _rank_of(group)
    longest = max(sum(min(TILE, plan.shape.Lq - t * TILE) for t in ts) for ts in plan.tiles)
    xm = x.movedim(dim, 0).contiguous()
    padded = torch.zeros((longest,) + tuple(xm.shape[1:]), dtype=x.dtype, device=x.device)
    padded[:xm.shape[0]] = xm
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather([p.view(torch.uint8) for p in parts], padded.view(torch.uint8), group=group)
    rows = [len(plan.rows(r)) for r in range(world)]
    return plan.unshard([p[:n].movedim(0, dim) for p, n in zip(parts, rows)], dim=dim)
