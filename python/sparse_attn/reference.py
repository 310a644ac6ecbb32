"""NumPy float64 references: what every operator of sparse_attn computes, written the slow and obvious
way (explicit masks, full score matrices, sorting) so that tests can compare against them.

Shapes follow the package: q (B, Lq, Hq, D), k and v (B, Lk, Hkv, D); masks are bool
(B, Hq, Lq, Lk). Inputs may be any floating numpy dtype (ml_dtypes.bfloat16 included); they are
converted to float64 first, so pass the same (already rounded) arrays the operator saw.
"""

from __future__ import annotations

import math

import numpy as np

TILE_Q = 128
BLOCK_K = 128
GATE_ROWS = 64  # queries per gate tile of gated (sparse_attn.GATE_ROWS)


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _ceil_div(a, b):
    return (a + b - 1) // b


def default_scale(D):
    return 1.0 / math.sqrt(D)


def causal_visibility(Lq, Lk, causal=True):
    """bool (Lq, Lk): query i sees key j iff j <= i + (Lk - Lq) (bottom-right aligned)."""
    if not causal:
        return np.ones((Lq, Lk), dtype=bool)
    i = np.arange(Lq)[:, None]
    j = np.arange(Lk)[None, :]
    return j <= i + (Lk - Lq)


def scores(q, k, softmax_scale=None):
    """Scaled scores float64 (B, Hq, Lq, Lk), K heads broadcast over their GQA group."""
    q, k = _f64(q), _f64(k)
    B, Lq, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = default_scale(D) if softmax_scale is None else float(softmax_scale)
    kr = np.repeat(k, Hq // Hkv, axis=2)  # head h uses KV head h // (Hq // Hkv)
    return scale * np.einsum("bihd,bjhd->bhij", q, kr)


def _expand_v(v, Hq):
    v = _f64(v)
    return np.repeat(v, Hq // v.shape[2], axis=2)


def attention(q, k, v, mask=None, softmax_scale=None, causal=False):
    """Masked softmax attention. mask: bool (B, Hq, Lq, Lk) or broadcastable, None = all keys.
    Returns (out float64 (B, Lq, Hq, D), lse float64 (B, Hq, Lq), natural log). Rows with no
    visible selected key give out = 0 and lse = -inf."""
    s = scores(q, k, softmax_scale)
    B, Hq, Lq, Lk = s.shape
    m = np.broadcast_to(causal_visibility(Lq, Lk, causal), s.shape)
    if mask is not None:
        m = m & np.broadcast_to(np.asarray(mask, dtype=bool), s.shape)
    s = np.where(m, s, -np.inf)
    row_max = s.max(axis=-1, keepdims=True)
    empty = ~np.isfinite(row_max)
    row_max = np.where(empty, 0.0, row_max)
    p = np.where(m, np.exp(s - row_max), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    safe = np.where(denom > 0, denom, 1.0)
    out = np.einsum("bhij,bjhd->bihd", p / safe, _expand_v(v, Hq))
    with np.errstate(divide="ignore"):
        lse = np.where(empty[..., 0], -np.inf, np.log(np.where(denom[..., 0] > 0, denom[..., 0], 1.0)) + row_max[..., 0])
    return out, lse


# ---- selections as explicit masks (selection only; visibility is applied by attention()) -------

def _group_of_head(Hq, G):
    """Index of the list used by each query head: G == Hq per head, else its GQA group."""
    return np.arange(Hq) if G == Hq else np.arange(Hq) // (Hq // G)


def mask_from_tile_lists(idx, cnt, Lq, Lk, Hq):
    idx, cnt = np.asarray(idx), np.asarray(cnt)
    B, G, Tq, _ = idx.shape
    blocks = np.zeros((B, G, Tq, _ceil_div(Lk, BLOCK_K)), dtype=bool)
    for b in range(B):
        for g in range(G):
            for t in range(Tq):
                for j in idx[b, g, t, : cnt[b, g, t]]:
                    blocks[b, g, t, j] = True
    return _blocks_to_mask(blocks, Lq, Lk, Hq)


def mask_from_block_bits(bits, Lq, Lk, Hq):
    bits = np.asarray(bits).astype(np.uint64)
    Tk = _ceil_div(Lk, BLOCK_K)
    j = np.arange(Tk)
    blocks = ((bits[..., j // 32] >> (j % 32).astype(np.uint64)) & 1).astype(bool)
    return _blocks_to_mask(blocks, Lq, Lk, Hq)


def _blocks_to_mask(blocks, Lq, Lk, Hq):
    """blocks bool (B, G, Tq, Tk) -> mask (B, Hq, Lq, Lk)."""
    B, G = blocks.shape[:2]
    per_head = blocks[:, _group_of_head(Hq, G)]                      # (B, Hq, Tq, Tk)
    rows = per_head[:, :, np.arange(Lq) // TILE_Q]                  # (B, Hq, Lq, Tk)
    return rows[..., np.arange(Lk) // BLOCK_K]                      # (B, Hq, Lq, Lk)


def mask_from_query_lists(idx, Lk, Hq):
    idx = np.asarray(idx)
    B, Hkv, Lq, _ = idx.shape
    blocks = np.zeros((B, Hkv, Lq, _ceil_div(Lk, BLOCK_K)), dtype=bool)
    bi, gi, ii, si = np.nonzero(idx >= 0)
    blocks[bi, gi, ii, idx[bi, gi, ii, si]] = True
    per_head = blocks[:, _group_of_head(Hq, Hkv)]
    return per_head[..., np.arange(Lk) // BLOCK_K]


def mask_from_token_lists(idx, Lk, Hq):
    idx = np.asarray(idx)
    B, Hkv, Lq, _ = idx.shape
    m = np.zeros((B, Hkv, Lq, Lk), dtype=bool)
    bi, gi, ii, si = np.nonzero(idx >= 0)
    m[bi, gi, ii, idx[bi, gi, ii, si]] = True
    return m[:, _group_of_head(Hq, Hkv)]


def tile_lists_to_block_bits(idx, cnt, Lk):
    idx, cnt = np.asarray(idx), np.asarray(cnt)
    B, G, Tq, _ = idx.shape
    words = np.zeros((B, G, Tq, _ceil_div(_ceil_div(Lk, BLOCK_K), 32)), dtype=np.uint32)
    for b, g, t in np.ndindex(B, G, Tq):
        for j in idx[b, g, t, : cnt[b, g, t]]:
            words[b, g, t, j // 32] |= np.uint32(1 << (int(j) % 32))
    return words


# ---- gated (BSFA) -------------------------------------------------------------------------------

def block_maxima(q, k, softmax_scale=None):
    """Causal block maxima of the scaled scores over each (gate tile of GATE_ROWS queries, KV block),
    float64 (B, Hq, Tg, Tk), -inf where nothing is visible; plus bool masks (visible, straddling) of
    the same shape: visible = some pair visible, straddling = visible but not every pair visible."""
    s = scores(q, k, softmax_scale)
    B, Hq, Lq, Lk = s.shape
    vis = causal_visibility(Lq, Lk, True)
    s = np.where(vis, s, -np.inf)
    Tg, Tk = _ceil_div(Lq, GATE_ROWS), _ceil_div(Lk, BLOCK_K)
    bmax = np.full((B, Hq, Tg, Tk), -np.inf)
    visible = np.zeros((Tg, Tk), dtype=bool)
    straddle = np.zeros((Tg, Tk), dtype=bool)
    for t in range(Tg):
        rows = slice(t * GATE_ROWS, (t + 1) * GATE_ROWS)
        for j in range(Tk):
            keys = slice(j * BLOCK_K, (j + 1) * BLOCK_K)
            sub = vis[rows, keys]
            visible[t, j] = sub.any()
            straddle[t, j] = sub.any() and not sub.all()
            if visible[t, j]:
                bmax[:, :, t, j] = s[:, :, rows, keys].max(axis=(-1, -2))
    return bmax, np.broadcast_to(visible, bmax.shape), np.broadcast_to(straddle, bmax.shape)


def gate_candidates(visible, straddle, sink_blocks=1):
    """The blocks the gate decides: visible, off the gate tile's diagonal, past the first sink_blocks."""
    sink = np.arange(visible.shape[-1]) < sink_blocks
    return visible & ~straddle & ~sink


def gated(q, k, v, thresholds, softmax_scale=None, sink_blocks=1):
    """BSFA gate, causal, per gate tile of GATE_ROWS queries: a visible block is kept when it
    straddles the gate tile's diagonal, is one of the first sink_blocks blocks, or its block max is
    >= thresholds[h, min(t, T - 1)]. Returns (out, lse, stats dict, kept bool (B, Hq, Tg, Tk))."""
    thresholds = _f64(thresholds)
    bmax, visible, straddle = block_maxima(q, k, softmax_scale)
    B, Hq, Tg, Tk = bmax.shape
    T = thresholds.shape[1]
    thr = thresholds[:, np.minimum(np.arange(Tg), T - 1)]            # (Hq, Tg)
    passed = bmax >= thr[None, :, :, None]
    candidates = gate_candidates(visible, straddle, sink_blocks)
    kept = visible & (~candidates | passed)
    Lq, Lk = q.shape[1], k.shape[1]
    mask = kept[:, :, np.arange(Lq) // GATE_ROWS][..., np.arange(Lk) // BLOCK_K]
    out, lse = attention(q, k, v, mask, softmax_scale, causal=True)
    stats = {
        "kept_blocks": int(kept.sum()),
        "visible_blocks": int(visible.sum()),
        "gated_candidates": int(candidates.sum()),
        "gated_kept": int((candidates & passed).sum()),
    }
    return out, lse, stats, kept


def calibrate(samples, budgets, softmax_scale=None, sink_blocks=1):
    """Thresholds of one layer from samples [(q, k), ...] (each [1, L, H, D], causal, Lq = Lk):
    per sample, head and gate tile, the k-th largest block max among the gate's candidates (-inf
    when fewer than k), averaged over the samples that reach the gate tile. Returns float64
    (n_budgets, Hq, max Tg)."""
    per_sample = []
    for q, k in samples:
        bmax, visible, straddle = block_maxima(q, k, softmax_scale)
        cand = gate_candidates(visible, straddle, sink_blocks)
        _, Hq, Tg, _ = bmax.shape
        t = np.full((len(budgets), Hq, Tg), -np.inf)
        for h, tq in np.ndindex(Hq, Tg):
            vals = np.sort(bmax[0, h, tq][cand[0, h, tq]])[::-1]
            for bi, kk in enumerate(budgets):
                if len(vals) >= kk:
                    t[bi, h, tq] = vals[kk - 1]
        per_sample.append(t)
    T = max(t.shape[2] for t in per_sample)
    total = np.zeros((len(budgets), per_sample[0].shape[1], T))
    count = np.zeros(T)
    for t in per_sample:
        total[:, :, : t.shape[2]] += t
        count[: t.shape[2]] += 1
    return total / count


# ---- entmax -------------------------------------------------------------------------------------

def entmax_probs(z, alpha):
    """alpha-entmax of each row of z (float64, -inf = masked): p = [(alpha - 1) z - tau]_+^(1/(alpha-1))
    with sum p = 1. Sorting gives tau exactly for alpha = 2 (sparsemax) and alpha = 1.5; other alphas
    go row by row through _entmax_row, which never forms tau itself. Rows without a finite entry give
    zeros."""
    z = _f64(z)
    shape = z.shape
    rows = z.reshape(-1, shape[-1])
    out = np.zeros_like(rows)
    live = np.isfinite(rows).any(axis=1)
    if alpha in (1.5, 2.0):
        x = (alpha - 1.0) * rows[live]                  # -inf stays -inf and never contributes
        # tau moves with the scores, so each row is taken relative to its max: tau is then of order 1
        # and neither it nor x - tau loses the row's differences at any magnitude (scores of 1e30).
        x = x - x.max(axis=1, keepdims=True)
        tau = np.array([_entmax_tau(r[np.isfinite(r)], alpha) for r in x])
        out[live] = np.maximum(x - tau[:, None], 0.0) ** (1.0 / (alpha - 1.0))
    else:
        for i in np.flatnonzero(live):
            finite = np.isfinite(rows[i])
            out[i, finite] = _entmax_row(rows[i, finite], alpha)
    return out.reshape(shape)


def _logsumexp(t):
    m = t.max()
    return m if m == -np.inf else m + np.log(np.exp(t - m).sum())


def _entmax_row(z, alpha):
    """Weights of one row of finite scores. For large alpha the weight of the support's smallest score
    z_s hangs on eps = (alpha - 1) z_s - tau far below the rounding of tau (1e-35 next to 29 at
    alpha = 30), so the row is solved relative to z_s: the support is the largest s whose mass at
    tau = (alpha - 1) z_s is below 1, and log eps is bisected so that
    sum ((alpha - 1)(z_i - z_s) + eps)^r = 1, everything in log space (r = 1 / (alpha - 1))."""
    am1 = alpha - 1.0
    r = 1.0 / am1
    order = np.argsort(-z, kind="stable")
    xs = z[order]
    n = len(xs)

    def log_mass_at(k):  # tau = (alpha - 1) xs[k]
        d = am1 * (xs[:k] - xs[k])
        d = d[d > 0]
        return _logsumexp(r * np.log(d)) if d.size else -np.inf

    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if log_mass_at(mid) < 0 else (lo, mid - 1)
    s = lo + 1
    d = am1 * (xs[:s] - xs[s - 1])
    with np.errstate(divide="ignore"):
        ld = np.log(d)                                  # -inf for the anchor and its ties

    def log_mass(lam):
        return _logsumexp(r * np.logaddexp(ld, lam))

    lam_hi = 0.0 if s == n else min(0.0, np.log(am1 * (xs[s - 1] - xs[s])))  # eps <= 1, tau >= next
    step = 1.0
    lam_lo = lam_hi - step
    while log_mass(lam_lo) >= 0:                        # G(-inf) < 0: double down to a bracket
        lam_hi, step = lam_lo, 2 * step
        lam_lo = lam_hi - step
    for _ in range(200):
        mid = 0.5 * (lam_lo + lam_hi)
        if mid in (lam_lo, lam_hi):
            break
        lam_lo, lam_hi = (lam_lo, mid) if log_mass(mid) >= 0 else (mid, lam_hi)
    w = np.zeros(n)
    w[order[:s]] = np.exp(r * np.logaddexp(ld, lam_hi))
    return w


def _entmax_tau(x, alpha):
    xs = np.sort(x)[::-1]
    n = len(xs)
    ks = np.arange(1, n + 1)
    if alpha == 2.0:
        csum = np.cumsum(xs)
        support = ks[1 + ks * xs > csum].max()
        return (csum[support - 1] - 1.0) / support
    if alpha == 1.5:
        # Peters et al. (2019), exact 1.5-entmax: with p = (x - tau)^2 over the top-k support,
        # tau solves k tau^2 - 2 S1 tau + S2 - 1 = 0.
        mean = np.cumsum(xs) / ks
        mean_sq = np.cumsum(xs * xs) / ks
        ss = ks * (mean_sq - mean * mean)
        delta = np.maximum((1.0 - ss) / ks, 0.0)
        tau = mean - np.sqrt(delta)
        support = int((tau <= xs).sum())
        return tau[support - 1]
    raise ValueError(f"exact sorting solution exists for alpha 1.5 and 2 only, got {alpha}")


def entmax_attention(q, k, v, alpha=1.5, softmax_scale=None, causal=False):
    """Returns (out float64 (B, Lq, Hq, D), p float64 (B, Hq, Lq, Lk))."""
    s = scores(q, k, softmax_scale)
    Lq, Lk = s.shape[2], s.shape[3]
    s = np.where(causal_visibility(Lq, Lk, causal), s, -np.inf)
    p = entmax_probs(s, alpha)
    out = np.einsum("bhij,bjhd->bihd", p, _expand_v(v, s.shape[1]))
    return out, p


# ---- selectors: block and token scores by brute force --------------------------------------------

def _pool(x, L, group):
    """Means of `group` consecutive rows of x (B, L, H, D) within each 128-row tile; partial tiles
    average what they hold. Returns (B, n_tiles, r, H, D) and bool (n_tiles, r) of non-empty reps."""
    x = _f64(x)
    B, _, H, D = x.shape
    n = _ceil_div(L, TILE_Q)
    r = TILE_Q // group
    reps = np.zeros((B, n, r, H, D))
    valid = np.zeros((n, r), dtype=bool)
    for t in range(n):
        for i in range(r):
            lo = t * TILE_Q + i * group
            hi = min(lo + group, L, (t + 1) * TILE_Q)
            if lo < hi:
                reps[:, t, i] = x[:, lo:hi].mean(axis=1)
                valid[t, i] = True
    return reps, valid


def pooled_scores(q, k, representatives=1):
    """Pooled block scores float64 (B, Hkv, Tq, Tk): max over representative pairs and over the
    query heads of the group of the dot products of representatives (no scale, no mask)."""
    B, Lq, Hq, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    group = TILE_Q // representatives
    qr, qv = _pool(q, Lq, group)
    kr, kv = _pool(k, Lk, group)
    Tq, Tk = qr.shape[1], kr.shape[1]
    gs = Hq // Hkv
    out = np.full((B, Hkv, Tq, Tk), -np.inf)
    for g in range(Hkv):
        qh = qr[:, :, :, g * gs:(g + 1) * gs]                           # (B, Tq, r, gs, D)
        kh = kr[:, :, :, g]                                            # (B, Tk, r, D)
        dots = np.einsum("btrhd,bjsd->btjrsh", qh, kh)                 # (B, Tq, Tk, r, r, gs)
        ok = qv[:, None, :, None] & kv[None, :, None, :]              # (Tq, Tk, r, r)
        dots = np.where(ok[None, ..., None], dots, -np.inf)
        out[:, g] = dots.max(axis=(3, 4, 5))
    return out


def pooled_candidates(Lq, Lk, causal):
    """bool (Tq, Tk): blocks visible to some query of the tile (all blocks when not causal)."""
    Tq, Tk = _ceil_div(Lq, TILE_Q), _ceil_div(Lk, BLOCK_K)
    if not causal:
        return np.ones((Tq, Tk), dtype=bool)
    last_q = np.minimum((np.arange(Tq) + 1) * TILE_Q, Lq) - 1
    return (np.arange(Tk)[None, :] * BLOCK_K) <= (last_q + Lk - Lq)[:, None]


def token_max_scores(qidx, kidx, causal=True, per_tile=False):
    """MSA block scores float64: per query (B, Hkv, Lq, Tk) the max over visible keys of the block
    of qidx . kidx, -inf where the block has no visible key; with per_tile, also maxed over the
    queries of each tile (B, Hkv, Tq, Tk)."""
    qidx, kidx = _f64(qidx), _f64(kidx)
    B, Lq, Hkv, _ = qidx.shape
    Lk = kidx.shape[1]
    kk = np.broadcast_to(kidx, (B, Lk, Hkv, kidx.shape[3]))
    s = np.einsum("bigd,bjgd->bgij", qidx, kk)
    s = np.where(causal_visibility(Lq, Lk, causal), s, -np.inf)
    Tk = _ceil_div(Lk, BLOCK_K)
    blocks = np.stack([s[..., j * BLOCK_K:(j + 1) * BLOCK_K].max(axis=-1) for j in range(Tk)], axis=-1)
    if not per_tile:
        return blocks
    Tq = _ceil_div(Lq, TILE_Q)
    return np.stack([blocks[:, :, t * TILE_Q:(t + 1) * TILE_Q].max(axis=2) for t in range(Tq)], axis=2)


def lightning_scores(qI, w, kI, causal=True):
    """DSA index scores float64 (B, Lq, Lk): sum_j w[t, j] relu(qI[t, j] . kI[s]); -inf where not
    visible."""
    qI, w, kI = _f64(qI), _f64(w), _f64(kI)
    dots = np.einsum("btjd,bsd->btjs", qI, kI)
    s = np.einsum("btj,btjs->bts", w, np.maximum(dots, 0.0))
    Lq, Lk = s.shape[1], s.shape[2]
    return np.where(causal_visibility(Lq, Lk, causal), s, -np.inf)


def top_k(scores_row, k):
    """Exact top-k of one row (ties to the lower index), -inf entries never chosen; ascending ids."""
    row = np.asarray(scores_row)
    cand = np.nonzero(np.isfinite(row))[0]
    order = cand[np.lexsort((cand, -row[cand]))]
    return np.sort(order[:k])


def selection_quality(q, k, v, mask, softmax_scale=None, causal=False):
    """What evaluate() reports, from an explicit selection mask (B, Hq, Lq, Lk)."""
    s = scores(q, k, softmax_scale)
    B, Hq, Lq, Lk = s.shape
    vis = np.broadcast_to(causal_visibility(Lq, Lk, causal), s.shape)
    sel = np.asarray(mask, dtype=bool) & vis
    dense_out, _ = attention(q, k, v, None, softmax_scale, causal)
    sparse_out, _ = attention(q, k, v, sel, softmax_scale, causal)
    z = np.where(vis, s, -np.inf)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    kept = (p * sel).sum(axis=-1)                                     # (B, Hq, Lq)
    Tq, Tk = _ceil_div(Lq, TILE_Q), _ceil_div(Lk, BLOCK_K)
    vis_tiles = sel_tiles = 0
    for t in range(Tq):
        for j in range(Tk):
            sv = vis[:, :, t * TILE_Q:(t + 1) * TILE_Q, j * BLOCK_K:(j + 1) * BLOCK_K].any(axis=(-1, -2))
            ss = sel[:, :, t * TILE_Q:(t + 1) * TILE_Q, j * BLOCK_K:(j + 1) * BLOCK_K].any(axis=(-1, -2))
            vis_tiles += int(sv.sum())
            sel_tiles += int(ss.sum())
    diff = sparse_out - dense_out
    return {
        "kept_mass_mean": float(kept.mean()),
        "kept_mass_min": float(kept.min()),
        "kept_mass_mean_per_head": kept.mean(axis=(0, 2)),
        "kept_mass_min_per_head": kept.min(axis=(0, 2)),
        "out_rel_err": float(np.linalg.norm(diff) / np.linalg.norm(dense_out)),
        "out_rel_err_per_head": np.array([np.linalg.norm(diff[:, :, h]) / np.linalg.norm(dense_out[:, :, h])
                                          for h in range(Hq)]),
        "token_sparsity": 1.0 - sel.sum() / vis.sum(),
        "block_sparsity": 1.0 - sel_tiles / vis_tiles,
        "selected_pairs": int(sel.sum()),
        "visible_pairs": int(vis.sum()),
    }


def rel_err(x, ref):
    """||x - ref|| / ||ref|| in float64 (NaN anywhere gives inf, so it never passes)."""
    x, ref = _f64(x), _f64(ref)
    if not np.all(np.isfinite(x)):
        return math.inf
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300))
