"""gated and its calibration on CUDA torch tensors against the CPU (skipped without torch and a GPU):
the same stats and kept blocks per gate tile (random inputs: no block maximum within rounding of a
threshold chosen between maxima), the torch op's device counters without a wait, and
calibrate_thresholds on the GPU against the CPU oracle."""
import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import reference as ref

torch = pytest.importorskip("torch")
sat = pytest.importorskip("sparse_attn.torch")
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() or not sa.cuda_available(),
                                 reason="needs torch with a CUDA device (sm_90)")]


def _qkv(B, Lq, Lk, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda L, H: torch.randn(B, L, H, D, generator=g).to(dtype)  # noqa: E731
    return mk(Lq, Hq), mk(Lk, Hkv), mk(Lk, Hkv)


def _midpoints(q, k, sinks):
    """Per (head, gate tile) a threshold halfway across the widest gap between neighbouring candidate
    maxima (float64 reference on the rounded inputs), so no decision is within rounding of it."""
    bmax, visible, straddle = ref.block_maxima(q.float().numpy(), k.float().numpy())
    cand = ref.gate_candidates(visible, straddle, sinks)
    _, Hq, Tg, _ = bmax.shape
    thr = np.full((Hq, Tg), -np.inf, dtype=np.float32)
    for h, t in np.ndindex(Hq, Tg):
        vals = np.unique(bmax[:, h, t][cand[:, h, t]])
        if len(vals) >= 2:
            i = int(np.argmax(np.diff(vals))) + 1
            thr[h, t] = 0.5 * (vals[i - 1] + vals[i])
    return torch.from_numpy(thr)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1013, 1013, 8, 2, 128), (2, 300, 700, 4, 4, 64)], ids=["L1013_gqa4", "B2_chunked"])
def test_cuda_gated_matches_cpu(dtype, shape):
    B, Lq, Lk, Hq, Hkv, D = shape
    q, k, v = _qkv(B, Lq, Lk, Hq, Hkv, D, dtype)
    thr = _midpoints(q, k, 1)
    cpu_out, cpu_lse, cpu_stats = sa.gated(q.float(), k.float(), v.float(), thr, return_lse=True,
                                           return_kept_per_tile=True)
    out, lse, stats = sat.gated(q.cuda(), k.cuda(), v.cuda(), thr.cuda(), return_lse=True, return_kept_per_tile=True)
    for name in ("kept_blocks", "visible_blocks", "gated_candidates", "gated_kept"):
        assert stats[name] == cpu_stats[name], name
    assert torch.equal(stats["kept_per_tile"].cpu(), cpu_stats["kept_per_tile"])
    assert 0 < stats["gated_kept"] < stats["gated_candidates"]
    err = (out.float().cpu() - cpu_out).norm() / cpu_out.norm()
    assert err < (1e-2 if dtype == torch.bfloat16 else 3e-3)
    torch.testing.assert_close(lse.cpu(), cpu_lse, rtol=0, atol=3e-3)


def test_cuda_gated_device_counters_need_no_wait():
    q, k, v = (x.cuda() for x in _qkv(1, 900, 900, 4, 2, 128, torch.bfloat16, seed=3))
    thr = torch.full((4, 1), 0.5, device="cuda")
    out, stats = sat.gated(q, k, v, thr, stats=False, return_kept_per_tile=True)
    counts = stats["counts"]
    assert counts.device.type == "cuda" and counts.dtype == torch.int32 and counts.shape == (4,)
    _, host = sat.gated(q, k, v, thr)
    assert counts.tolist() == [host[n] for n in sa._GATED_COUNTS]
    assert int(stats["kept_per_tile"].sum()) == host["kept_blocks"]
    # -inf thresholds: the dense causal output.
    g_out, _ = sat.gated(q, k, v, torch.full((4, 1), float("-inf"), device="cuda"))
    assert torch.equal(g_out, sat.dense(q, k, v, causal=True))


@pytest.mark.parametrize("sinks", [0, 1])
def test_cuda_calibration_matches_cpu(sinks):
    samples = [[_qkv(1, L, L, 4, 2, 64, torch.bfloat16, seed=L)[:2]] for L in (700, 1013)]
    cpu = sa.calibrate_thresholds(samples, [1, 3], sink_blocks=sinks, model="m")
    gpu = sa.calibrate_thresholds(([(q.cuda(), k.cuda()) for q, k in s] for s in samples), [1, 3],
                                  sink_blocks=sinks, model="m")
    assert (gpu.sink_blocks, gpu.n_qtiles, gpu.model) == (sinks, 16, "m")
    a, b = cpu.values, gpu.values
    np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
    np.testing.assert_allclose(b[np.isfinite(b)], a[np.isfinite(a)], rtol=1e-5, atol=1e-5)
