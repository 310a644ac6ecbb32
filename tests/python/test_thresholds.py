import numpy as np
import pytest

import sparse_attn as sa
from sparse_attn import reference as ref

from _util import qkv, randn


def test_table_construction_and_slices(rng):
    values = randn(rng, (2, 3, 4, 5))
    t = sa.ThresholdTable([4, 8], n_layers=3, n_heads=4, n_qtiles=5, values=values, model="m")
    np.testing.assert_array_equal(t.values, values)
    assert t.budget_index(8) == 1
    assert t.at(1, 2, 3, 4) == values[1, 2, 3, 4]
    np.testing.assert_array_equal(t.slice(1, 2), values[1, 2])
    with pytest.raises(ValueError):
        t.budget_index(5)
    with pytest.raises(ValueError, match="values"):
        sa.ThresholdTable([4], n_layers=1, n_heads=1, n_qtiles=2, values=np.zeros(3, np.float32))
    assert "budgets=[4, 8]" in repr(t)


def test_save_load_round_trip_is_a_safetensors_file(rng, tmp_path):
    values = randn(rng, (1, 2, 3, 4))
    values[0, 0, 0, :2] = -np.inf  # short histories keep every block
    t = sa.ThresholdTable([16], n_layers=2, n_heads=3, n_qtiles=4, values=values, model="tiny-llm")
    path = tmp_path / "t.safetensors"
    t.save(str(path))
    back = sa.load_thresholds(path)
    assert (back.budgets, back.n_layers, back.n_heads, back.n_qtiles) == ([16], 2, 3, 4)
    assert (back.tile_q, back.tile_k, back.model, back.sink_blocks) == (64, 128, "tiny-llm", 1)
    np.testing.assert_array_equal(back.values, values)
    safetensors = pytest.importorskip("safetensors.numpy")
    data = safetensors.load_file(str(path))
    np.testing.assert_array_equal(data["thresholds"], values)
    np.testing.assert_array_equal(data["budgets"], [16])


def test_load_rejects_missing_and_garbage_files(tmp_path):
    with pytest.raises(ValueError):
        sa.load_thresholds(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 40)
    with pytest.raises(ValueError):
        sa.load_thresholds(bad)


def test_calibrator_matches_reference_and_drives_gated(rng):
    budgets = [1, 3]
    samples = [qkv(rng, 1, L, L, 2, 1, 16)[:2] for L in (300, 520, 400)]
    cal = sa.Calibrator(budgets, n_layers=2, model="unit")
    for q, k in samples:
        cal.add(1, q, k)
        cal.add(0, q[:, :200], k[:, :200])
    table = cal.finish()
    assert table.budgets == budgets and table.n_layers == 2 and table.n_heads == 2
    assert table.n_qtiles == 9 and table.model == "unit" and table.sink_blocks == 1  # ceil(520 / 64)
    expect = ref.calibrate(samples, budgets)
    got = table.values[:, 1]
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expect))
    np.testing.assert_allclose(got[np.isfinite(got)], expect[np.isfinite(expect)], rtol=1e-5, atol=1e-6)
    expect0 = ref.calibrate([(q[:, :200], k[:, :200]) for q, k in samples], budgets)
    np.testing.assert_array_equal(np.isinf(table.values[:, 0, :, :4]), np.isinf(expect0))
    # The table plugs into gated: a slice of one budget and layer.
    q, k, v = qkv(rng, 1, 520, 520, 2, 1, 16)
    thr = table.slice(table.budget_index(1), 1)
    out, stats = sa.gated(q, k, v, thr)
    ref_out, _, ref_stats, _ = ref.gated(q, k, v, thr)
    assert ref.rel_err(out, ref_out) <= 1e-5
    assert stats["visible_blocks"] == ref_stats["visible_blocks"]


@pytest.mark.parametrize("sinks", [0, 2])
def test_sink_blocks_follow_through_calibration_and_gate(rng, sinks):
    samples = [qkv(rng, 1, L, L, 2, 1, 16)[:2] for L in (450, 700)]
    cal = sa.Calibrator([1, 2], n_layers=1, sink_blocks=sinks)
    for q, k in samples:
        cal.add(0, q, k)
    table = cal.finish()
    assert table.sink_blocks == sinks and f"sink_blocks={sinks}" in repr(table)
    expect = ref.calibrate(samples, [1, 2], sink_blocks=sinks)
    got = table.values[:, 0]
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expect))
    np.testing.assert_allclose(got[np.isfinite(got)], expect[np.isfinite(expect)], rtol=1e-5, atol=1e-6)
    q, k, v = qkv(rng, 1, 700, 700, 2, 1, 16)
    thr = table.slice(0, 0)
    out, stats = sa.gated(q, k, v, thr, sink_blocks=sinks)
    ref_out, _, ref_stats, _ = ref.gated(q, k, v, thr, sink_blocks=sinks)
    assert ref.rel_err(out, ref_out) <= 1e-5
    assert stats["gated_candidates"] == ref_stats["gated_candidates"]
    assert stats["visible_blocks"] == ref_stats["visible_blocks"]


def test_calibrate_thresholds_streams_samples_of_every_layer(rng):
    samples = [[qkv(rng, 1, L, L, 2, 1, 16)[:2] for _ in range(2)] for L in (300, 520)]
    table = sa.calibrate_thresholds(iter(samples), [1, 3], sink_blocks=0, model="streamed")
    assert (table.n_layers, table.n_qtiles, table.sink_blocks, table.model) == (2, 9, 0, "streamed")
    for layer in range(2):
        expect = ref.calibrate([s[layer] for s in samples], [1, 3], sink_blocks=0)
        got = table.values[:, layer]
        np.testing.assert_array_equal(np.isinf(got), np.isinf(expect))
        np.testing.assert_allclose(got[np.isfinite(got)], expect[np.isfinite(expect)], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no calibration sample"):
        sa.calibrate_thresholds([], [1])
    with pytest.raises(ValueError, match="budgets"):
        sa.calibrate_thresholds(samples, [0])
