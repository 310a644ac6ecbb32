"""The GPU benchmark drivers' pure-Python parts, which CI can run without a GPU: the pipeline
benchmark's self-test (list checks, pair counting, JSON, table) and the attention plot's readers on
a committed H200 result file."""
import importlib.util
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pipeline_bench_selftest():
    r = subprocess.run([sys.executable, str(ROOT / "bench/gpu/bench_pipeline.py"), "--selftest"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "selftest ok" in r.stdout


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
