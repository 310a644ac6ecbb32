"""Every method of the Hugging Face attention function (sparse_attn.hf) on random torch CPU tensors:
the output is attention over the selection the recorder reports, budgets hold, the oracle keeps the
most mass, decode and short prompts run dense, padding and bad options raise Error."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparse_attn as sa  # noqa: E402
from sparse_attn import hf  # noqa: E402
from sparse_attn import reference as ref  # noqa: E402


class Module:
    is_causal = True

    def __init__(self, layer_idx=0):
        self.layer_idx = layer_idx


def _inputs(B=1, L=640, Hq=6, Hkv=2, D=32, seed=0):
    """HF layout (B, H, L, D); keys with a few strong directions so that selections differ."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g) + 2.0 * torch.randn(B, Hkv, 1, D, generator=g)
    return q, k, torch.randn(B, Hkv, L, D, generator=g)


def _np(t):
    return t.detach().float().numpy()


def _flash(*ts):
    return [_np(t.transpose(1, 2)) for t in ts]


def _call(method, q, k, v, scale=0.2, recorder=None, **options):
    fn = hf.make_hf_attention(method, recorder=recorder, **options)
    out, weights = fn(Module(), q, k, v, None, scaling=scale)
    assert weights is None
    return out


class PairRecorder(hf.Recorder):
    """Keeps the pair mask of the last call (the selection the executor ran)."""

    def record(self, layer, q, k, scale, causal, pairs):
        self.pairs = None if pairs is None else pairs.clone()
        super().record(layer, q, k, scale, causal, pairs)


@pytest.mark.parametrize("method,options", [
    ("pooled", {}), ("pooled", {"representatives": 4}), ("pooled", {"sink_blocks": 2, "local_blocks": 2}),
    ("token_max", {}), ("token_max", {"granularity": "query"}), ("lightning", {}),
    ("lightning", {"lightning_format": "block"}), ("oracle", {}), ("auto", {}), ("dense", {}),
])
def test_output_is_attention_over_the_recorded_selection(method, options):
    q, k, v = _inputs()
    rec = PairRecorder(mass=True)
    out = _call(method, q, k, v, recorder=rec, budget=3, **options)
    qn, kn, vn = _flash(q, k, v)
    mask = None
    if rec.pairs is not None:
        pairs = rec.pairs.repeat_interleave(q.shape[1] // rec.pairs.shape[1], dim=1)
        mask = pairs.numpy()
    expect, _ = ref.attention(qn, kn, vn, mask, softmax_scale=0.2, causal=True)
    assert ref.rel_err(_np(out), expect) <= 1e-5
    s = rec.summary()
    assert s["calls"] == 1 and 0 < s["block_density"] <= 1 and 0 < s["kept_mass"] <= 1 + 1e-6
    if method != "dense":
        assert s["block_density"] < 1 and s["pair_density"] < 1
    if method == "auto":
        assert sum(s["schedules"].values()) == 1


@pytest.mark.parametrize("method", ["pooled", "token_max", "oracle"])
@pytest.mark.parametrize("budget", [3, 0.5])
def test_tile_methods_keep_at_most_budget_blocks_per_tile(method, budget):
    q, k, v = _inputs(L=1024)
    rec = PairRecorder()
    _call(method, q, k, v, recorder=rec, budget=budget)
    blocks = 3 if budget == 3 else math.ceil(budget * 8)
    per_tile = rec.pairs.view(1, -1, 8, 128, 8, 128).any(-1).any(3)  # [B, G, Tq, Tk]
    assert int(per_tile.sum(-1).max()) == blocks  # the last tiles see more than `blocks` blocks
    assert bool(per_tile[..., 0].all())  # the sink block


def test_oracle_keeps_the_most_mass_of_the_tile_selectors():
    q, k, v = _inputs(L=1024, seed=3)
    mass = {}
    for method, options in [("oracle", {}), ("pooled", {}), ("pooled", {"representatives": 4}), ("token_max", {})]:
        rec = hf.Recorder(mass=True)
        _call(method, q, k, v, recorder=rec, budget=3, **options)
        mass[(method, options.get("representatives"))] = rec.summary()["kept_mass"]
    best = mass.pop(("oracle", None))
    assert all(best >= m - 1e-6 for m in mass.values()), (best, mass)


def test_gated_with_a_table_and_minus_infinity_thresholds_is_dense(tmp_path):
    q, k, v = _inputs()
    Hq = q.shape[1]
    table = sa.ThresholdTable([1, 2], 1, Hq, 3, model="test")  # gate tiles of GATE_ROWS, 1 sink block
    values = np.full((2, 1, Hq, 3), -np.inf, dtype=np.float32)
    # budget 4 -> the slice for 4 - 1 (diagonal) - 1 (sink) = 2 gated blocks: a real gate, at the
    # median block max of the gate's candidates
    bmax, visible, straddle = ref.block_maxima(*_flash(q, k), softmax_scale=0.2)
    values[1] = np.median(bmax[ref.gate_candidates(visible, straddle, 1)])
    table.values = values
    table.save(str(tmp_path / "t.safetensors"))
    dense = _call("dense", q, k, v)
    rec = hf.Recorder()
    out = _call("gated", q, k, v, recorder=rec, budget=3, thresholds=str(tmp_path / "t.safetensors"))
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    assert rec.summary()["block_density"] == 1.0
    rec = PairRecorder()
    out = _call("gated", q, k, v, recorder=rec, budget=4, thresholds=table)
    qn, kn, vn = _flash(q, k, v)
    expect, _, stats, kept = ref.gated(qn, kn, vn, values[1, 0], softmax_scale=0.2, sink_blocks=1)
    assert ref.rel_err(_np(out), expect) <= 1e-5
    assert torch.equal(rec.pairs[:, :, ::sa.GATE_ROWS, ::128], torch.from_numpy(kept))
    assert 0 < rec.summary()["block_density"] < 1
    with pytest.raises(sa.Error, match="no slice for budget 3"):
        _call("gated", q, k, v, budget=5, thresholds=table)


def test_entmax_runs_the_entmax_executor_and_reports_its_support():
    q, k, v = _inputs()
    rec = hf.Recorder()
    out = _call("entmax", q, k, v, recorder=rec, alpha=1.5)
    qn, kn, vn = _flash(q, k, v)
    expect = ref.entmax_attention(qn, kn, vn, alpha=1.5, softmax_scale=0.2, causal=True)[0]
    assert ref.rel_err(_np(out), expect) <= 1e-4
    assert 0 < rec.summary()["block_density"] <= 1


def test_decode_steps_and_short_prompts_run_dense():
    q, k, v = _inputs()
    for qq, options in [(q[:, :, -1:], {}), (q, {"min_length": 1000})]:
        out = _call("token_max", qq, k, v, budget=1, **options)
        torch.testing.assert_close(out, _call("dense", qq, k, v))
    # a chunk of queries after a cache (Lq < Lk) runs the method, bottom-right aligned
    out = _call("oracle", q[:, :, -200:], k, v, budget=2)
    assert out.shape == (1, 200, 6, 32) and bool(torch.isfinite(out).all())


def test_padding_and_bad_options_raise():
    q, k, v = _inputs(L=200)
    fn = hf.make_hf_attention("pooled")
    with pytest.raises(sa.Error, match="attention_mask"):
        fn(Module(), q, k, v, torch.ones(1, 200, dtype=torch.bool), scaling=0.2)
    with pytest.raises(sa.Error, match="'method'"):
        hf.make_hf_attention("flex")
    with pytest.raises(sa.Error, match="'thresholds'"):
        hf.make_hf_attention("gated")
    with pytest.raises(sa.Error, match="'budget'"):
        hf.make_hf_attention("oracle", budget=1.5)
    with pytest.raises(sa.Error, match="'sink_blocks'"):
        hf.make_hf_attention("oracle", sink_blocks=-1)
    with pytest.raises(sa.Error, match="'granularity'"):
        hf.make_hf_attention("token_max", granularity="head")
    with pytest.raises(sa.Error, match="'method' or its earlier spelling 'mode'"):
        hf.make_hf_attention("dense", mode="dense")


@pytest.mark.parametrize("schedule", ["q_centric", "kv_centric", "group_centric"])
def test_auto_runs_the_planned_schedule_and_records_what_it_ran(monkeypatch, schedule):
    """Each schedule the planner may choose (forced here: the planner's cost model is the H200's):
    q_centric attends each query to its tile's union of lists, the others to the query's list."""
    monkeypatch.setattr(hf, "plan_schedule", lambda lists, shape: {"schedule": schedule})
    q, k, v = _inputs(L=700)
    rec = PairRecorder()
    out = _call("auto", q, k, v, recorder=rec, budget=3)
    assert rec.schedules == {schedule: 1}
    qn, kn, vn = _flash(q, k, v)
    pairs = rec.pairs.repeat_interleave(3, dim=1).numpy()
    expect, _ = ref.attention(qn, kn, vn, pairs, softmax_scale=0.2, causal=True)
    assert ref.rel_err(_np(out), expect) <= 1e-5
    per_query = rec.pairs[..., ::128].sum(-1)  # blocks per query
    assert (int(per_query.max()) > 3) == (schedule == "q_centric")


# ---- CUDA ----------------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with a CUDA device")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("method,options", [
    ("dense", {}), ("pooled", {}), ("token_max", {}), ("token_max", {"granularity": "query"}), ("lightning", {}),
    ("lightning", {"lightning_format": "block"}), ("oracle", {}), ("auto", {}), ("gated", {}), ("entmax", {}),
])
def test_cuda_methods_match_the_reference_on_their_selection(method, options):
    """bf16 on the GPU: attention over the recorded selection (gated: its gate; entmax: the entmax
    reference). gated and entmax need the library's CUDA gated and entmax."""
    q, k, v = (t.to("cuda", torch.bfloat16) for t in _inputs(L=1000, Hq=8, Hkv=2, D=128))
    if method == "gated":
        table = sa.ThresholdTable([1], 1, 8, 1, values=np.full((1, 1, 8, 1), 1.0, dtype=np.float32))
        options = dict(options, thresholds=table)
    rec = PairRecorder()
    out = _call(method, q, k, v, scale=0.05, recorder=rec, budget=3, **options)
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16
    qn, kn, vn = _flash(q.cpu(), k.cpu(), v.cpu())
    if method == "entmax":
        expect = ref.entmax_attention(qn, kn, vn, alpha=1.5, softmax_scale=0.05, causal=True)[0]
    else:
        mask = None if rec.pairs is None else rec.pairs.repeat_interleave(
            8 // rec.pairs.shape[1], dim=1).cpu().numpy()
        expect, _ = ref.attention(qn, kn, vn, mask, softmax_scale=0.05, causal=True)
    assert ref.rel_err(_np(out.cpu()), expect) <= 1e-2
