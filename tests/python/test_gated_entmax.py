import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import reference as ref

from _util import assert_close, assert_lse, poisoned, qkv


def _midpoint_thresholds(bmax, visible, straddle, rng):
    """Per (head, gate tile) a threshold halfway between two neighbouring block maxima of the gated
    candidates, so no block max lies near a threshold and the gate decision is unambiguous."""
    _, Hq, Tg, _ = bmax.shape
    thr = np.full((Hq, Tg), -np.inf, dtype=np.float32)
    for h, t in np.ndindex(Hq, Tg):
        vals = np.unique(bmax[:, h, t][ref.gate_candidates(visible, straddle)[:, h, t]])
        if len(vals) >= 2:
            i = int(rng.integers(1, len(vals)))
            thr[h, t] = 0.5 * (vals[i - 1] + vals[i])
    return thr


@pytest.mark.parametrize("shape", [(1, 600, 600, 4, 1, 32), (2, 300, 430, 2, 2, 32), (1, 1, 400, 16, 1, 32)],
                         ids=["L600_gqa4", "B2_Lq300_Lk430_mha", "Lq1_gqa16"])
def test_gated_against_reference_gate(rng, shape):
    B, Lq, Lk, Hq, Hkv, D = shape
    q, k, v = qkv(rng, B, Lq, Lk, Hq, Hkv, D)
    bmax, visible, straddle = ref.block_maxima(q, k)
    thr = _midpoint_thresholds(bmax, visible, straddle, rng)
    out, lse, stats = sa.gated(q, k, v, thr, return_lse=True, return_kept_per_tile=True,
                               out=poisoned(q.shape, "float32"))
    ref_out, ref_lse, ref_stats, kept = ref.gated(q, k, v, thr)
    assert_close(out, ref_out, "float32")
    assert_lse(lse, ref_lse)
    for key, value in ref_stats.items():
        assert stats[key] == value, key
    assert stats["density"] == pytest.approx(ref_stats["kept_blocks"] / ref_stats["visible_blocks"])
    np.testing.assert_array_equal(stats["kept_per_tile"], kept.sum(axis=-1))


def test_gated_minus_inf_keeps_every_block_and_equals_dense_causal(rng):
    q, k, v = qkv(rng, 1, 300, 300, 4, 2, 32)
    out, stats = sa.gated(q, k, v, np.full((4, 1), -np.inf, dtype=np.float32))
    assert stats["kept_blocks"] == stats["visible_blocks"] and stats["density"] == 1.0
    assert_close(out, ref.attention(q, k, v, causal=True)[0], "float32")


def test_gated_reuses_the_last_calibrated_tile(rng):
    # Five gate tiles, thresholds for one: every gate tile uses column 0.
    q, k, v = qkv(rng, 1, 300, 300, 2, 1, 32)
    bmax, visible, straddle = ref.block_maxima(q, k)
    thr = np.full((2, 1), np.float32(np.median(bmax[np.isfinite(bmax)])))
    out, stats = sa.gated(q, k, v, thr)
    ref_out, _, ref_stats, _ = ref.gated(q, k, v, thr)
    assert_close(out, ref_out, "float32")
    assert stats["gated_kept"] == ref_stats["gated_kept"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
@pytest.mark.parametrize("shape", [(1, 17, 300, 4, 1, 32, False), (2, 140, 140, 2, 2, 32, True),
                                   (1, 1, 200, 16, 1, 32, True)],
                         ids=["Lq17_gqa4", "B2_Lq140_causal", "Lq1_gqa16_causal"])
def test_entmax_against_sorting_reference(rng, shape, alpha, dtype):
    B, Lq, Lk, Hq, Hkv, D, causal = shape
    # Larger scores make the support sparse enough for block skipping to matter.
    q, k, v = qkv(rng, B, Lq, Lk, Hq, Hkv, D, dtype, scale=2.0)
    out, bits, stats = sa.entmax(q, k, v, alpha=alpha, causal=causal, return_block_bits=True,
                                 return_stats=True, out=poisoned(q.shape, dtype))
    ref_out, p = ref.entmax_attention(q, k, v, alpha=alpha, causal=causal)
    assert_close(out, ref_out, dtype)
    # Block bits: every tile holding clear weight is set; a set tile holds weight or lies at the
    # support boundary (entries within rounding of tau).
    Tq, Tk = (Lq + 127) // 128, (Lk + 127) // 128
    assert bits.dtype == np.uint32 and bits.shape == (B, Hq, Tq, (Tk + 31) // 32)
    for b, h, t, j in np.ndindex(B, Hq, Tq, Tk):
        tile_max = p[b, h, t * 128:(t + 1) * 128, j * 128:(j + 1) * 128].max()
        is_set = bool((int(bits[b, h, t, j // 32]) >> (j % 32)) & 1)
        if tile_max > 1e-4:
            assert is_set, (b, h, t, j)
    assert stats["support"] == pytest.approx(int((p > 0).sum()), rel=1e-2, abs=4)
    assert 0 < stats["active_tiles"] <= stats["visible_tiles"]


def test_entmax_sparsity_skips_blocks(rng):
    # Query i is a large multiple of key i of block 0, so sparsemax keeps that key alone and only
    # the first of the 8 blocks is active.
    _, k, v = qkv(rng, 1, 128, 1024, 1, 1, 32)
    q = np.ascontiguousarray(10.0 * k[:, :128])
    out, bits, stats = sa.entmax(q, k, v, alpha=2.0, return_block_bits=True, return_stats=True)
    assert stats["visible_tiles"] == 8 and stats["active_tiles"] == 1
    assert stats["support"] == 128
    np.testing.assert_array_equal(bits, np.ones((1, 1, 1, 1), dtype=np.uint32))
    assert_close(out, ref.entmax_attention(q, k, v, alpha=2.0)[0], "float32")
