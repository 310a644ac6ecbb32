import subprocess
import sys

import numpy as np
import pytest

import sparse_attn as sa

from _util import ml_dtypes


def test_import_does_not_import_torch():
    code = "import sys, sparse_attn; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_build_info_and_devices():
    info = sa.build_info()
    assert info["version"] == sa.__version__ and info["cpu_threads"] >= 1
    assert isinstance(info["cuda"], bool) and info["compiler"]
    devices = sa.cuda_devices()
    assert isinstance(devices, list)
    for d in devices:
        assert {"index", "name", "major", "minor", "memory_bytes", "supported"} <= set(d)
    assert sa.cuda_available() == any(d["supported"] for d in devices)
    assert sa.TILE_Q == 128 and sa.BLOCK_K == 128


def test_e4m3_matches_ml_dtypes_on_every_code():
    if ml_dtypes is None:
        pytest.skip("ml_dtypes is not installed")
    codes = np.arange(256, dtype=np.uint8)
    values = sa.e4m3_to_float(codes)
    expect = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.isfinite(expect)
    np.testing.assert_array_equal(values[finite], expect[finite])
    assert np.all(np.isnan(values[~finite]))
    x = np.random.default_rng(1).standard_normal(4096).astype(np.float32) * 100
    x = x[np.abs(x) <= 448]
    np.testing.assert_array_equal(sa.float_to_e4m3(x), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert sa.e4m3_to_float(sa.float_to_e4m3(np.array([1e6, -1e6], np.float32))).tolist() == [448.0, -448.0]


def test_e2m1_matches_ml_dtypes():
    if ml_dtypes is None or not hasattr(ml_dtypes, "float4_e2m1fn"):
        pytest.skip("ml_dtypes without float4_e2m1fn")
    codes = np.arange(16, dtype=np.uint8)
    expect = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(sa.e2m1_to_float(codes), expect)
    x = np.random.default_rng(2).uniform(-6, 6, 2048).astype(np.float32)
    np.testing.assert_array_equal(sa.e2m1_to_float(sa.float_to_e2m1(x)),
                                  x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert sa.e2m1_to_float(sa.float_to_e2m1(np.array([7.5, -100.0], np.float32))).tolist() == [6.0, -6.0]


def test_conversions_keep_shape():
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    assert sa.float_to_e4m3(x).shape == (2, 3, 4) and sa.float_to_e4m3(x).dtype == np.uint8
    assert sa.e4m3_to_float(sa.float_to_e4m3(x)).dtype == np.float32


def test_quantize_dequantize_in_place():
    if ml_dtypes is None:
        pytest.skip("ml_dtypes is not installed")
    row = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    scale = float(np.abs(row).max() / 448)
    expect = (row / np.float32(scale)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(scale)
    sa.quantize_dequantize(row, "fp8_e4m3", scale)
    np.testing.assert_allclose(row, expect, rtol=1e-6)
    assert sa.precision_name("fp8") == "fp8_e4m3"
    with pytest.raises(ValueError, match="precision"):
        sa.quantize_dequantize(row, "fp5", 1.0)
