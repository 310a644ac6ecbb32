"""Inputs from a hostile user: every one is refused with sparse_attn.Error naming the argument, where
each used to crash the interpreter, read out of bounds or load."""
import struct

import numpy as np
import pytest

import sparse_attn as sa


def test_problem_shape_extents_are_checked():
    with pytest.raises(sa.Error, match="argument 'Hkv': must be in \\[1, 2147483647\\], got 0"):
        sa.ProblemShape(1, 128, 128, 4, 0)  # group_size divided by zero
    with pytest.raises(sa.Error, match="argument 'Lq'"):
        sa.ProblemShape(1, 2**63 - 1, 128, 4, 1)  # Tq overflowed to a negative count
    with pytest.raises(sa.Error, match="argument 'Hq': 6 query heads are not a multiple of the 4 KV heads"):
        sa.ProblemShape(1, 128, 128, 6, 4)
    p = sa.ProblemShape(1, 300, 1000, 4, 2, 64, causal=True)
    with pytest.raises(sa.Error, match="argument 'Hkv'"):
        p.Hkv = 0
    assert (p.Hkv, p.group_size, p.Tq) == (2, 2, 3)  # unchanged by the refused assignment
    p.Lq = 2**31 - 1
    assert p.Tq == (2**31 - 1 + 127) // 128
    p.causal = False
    assert p.visible(0, 999) and p.key_end(5) == 1000
    with pytest.raises(sa.Error, match="argument 'i': -1 is out of range"):
        p.key_end(-1)
    with pytest.raises(sa.Error, match="argument 'j'"):
        p.visible(0, 2**63 - 1)


def test_threshold_table_extents_are_checked_and_read_only():
    with pytest.raises(sa.Error, match="overflow"):
        sa.ThresholdTable([1], 2**62, 4, 1)  # the product wrapped to 0, then at() read anywhere
    with pytest.raises(sa.Error, match="argument 'n_heads': must be >= 1, got 0"):
        sa.ThresholdTable([1], 1, 0, 1)
    t = sa.ThresholdTable([1, 4], 1, 2, 3)
    for name in ("budgets", "n_layers", "n_heads", "n_qtiles"):
        with pytest.raises(AttributeError):
            setattr(t, name, 10**6)
    assert t.values.shape == (2, 1, 2, 3)
    with pytest.raises(sa.Error, match="argument 'values'"):
        t.values = np.zeros(5, np.float32)


def test_threshold_table_budgets_are_checked(tmp_path):
    with pytest.raises(sa.Error, match="argument 'budgets': budget -5 at \\[0\\] must be >= 1"):
        sa.ThresholdTable([-5, -5], 1, 1, 1)
    with pytest.raises(sa.Error, match="budget 3 is repeated"):
        sa.ThresholdTable([3, 3], 1, 1, 1)


def _safetensors(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_hostile_threshold_files_raise_the_library_error(tmp_path):
    deep = b'{"thresholds": {"dtype": "F32", "shape": [' + b"[" * 70000 + b"]" * 70000 + b'], "data_offsets": [0, 0]}}'
    cases = {
        "deep": (deep, "nests deeper than 8 levels"),
        "nul": (b'{"__metadata__": {"format": "x"}}\0garbage', "control byte 0x00"),
        "utf8": (b'{"__metadata__": {"model": "\xff\xfe"}}', "byte 0xff at offset 28 is not UTF-8"),
    }
    for name, (header, message) in cases.items():
        path = _safetensors(tmp_path / f"{name}.safetensors", header)
        with pytest.raises(sa.Error, match=message) as e:
            sa.load_thresholds(path)
        assert str(path) in str(e.value) and "ThresholdTable" in str(e.value)
    with pytest.raises(sa.Error, match="it is a directory"):
        sa.load_thresholds(tmp_path)
