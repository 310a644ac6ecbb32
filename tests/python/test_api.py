"""The package's conventions hold for every function: one `causal` default, and validate() checks
whatever it is given. (The torch side of both, and gated's result through sparse_attn.torch, is in
test_torch.py.)"""

import numpy as np

import sparse_attn as sa

from _util import causal_defaults, randn


def test_every_causal_argument_defaults_to_false():
    defaults = causal_defaults(sa)
    # Executors, selectors and the helpers all take it; a function that loses it should be noticed.
    for name in ("dense", "tile_sparse", "bits_sparse", "query_sparse", "token_sparse", "sparse_attention",
                 "entmax", "pooled_select", "token_max_select", "lightning_select", "problem_shape", "evaluate"):
        assert name in defaults, name
    assert {n: d for n, d in defaults.items() if d is not False} == {}


def test_selectors_without_causal_select_as_non_causal(rng):
    # Lq = Lk: causal, query i sees only blocks up to its own, so the early queries' lists differ.
    B, L, Hkv, Di = 1, 400, 2, 16
    qidx, kidx = randn(rng, (B, L, Hkv, Di)), randn(rng, (B, L, Hkv, Di))
    plain = sa.token_max_select(qidx, kidx, top_k=3)
    assert np.array_equal(plain, sa.token_max_select(qidx, kidx, top_k=3, causal=False))
    assert not np.array_equal(plain, sa.token_max_select(qidx, kidx, top_k=3, causal=True))

    qI, kI = randn(rng, (B, L, 2, Di)), randn(rng, (B, L, Di))
    w = np.abs(randn(rng, (B, L, 2))) + 0.1
    plain = sa.lightning_select(qI, w, kI, top_k=8, precision="bf16")
    assert np.array_equal(plain, sa.lightning_select(qI, w, kI, top_k=8, precision="bf16", causal=False))
    assert not np.array_equal(plain, sa.lightning_select(qI, w, kI, top_k=8, precision="bf16", causal=True))

    q, k = randn(rng, (B, L, 4, Di)), randn(rng, (B, L, Hkv, Di))
    idx, cnt = sa.pooled_select(q, k, top_k=2)
    want_idx, want_cnt = sa.pooled_select(q, k, top_k=2, causal=False)
    assert np.array_equal(idx, want_idx) and np.array_equal(cnt, want_cnt)


def test_gated_stats_hold_python_numbers(rng):
    q, k, v = randn(rng, (1, 300, 2, 16)), randn(rng, (1, 300, 1, 16)), randn(rng, (1, 300, 1, 16))
    out, stats = sa.gated(q, k, v, np.zeros((2, 3), np.float32))
    assert set(stats) == {"kept_blocks", "visible_blocks", "gated_candidates", "gated_kept", "density"}
    assert all(type(stats[n]) is int for n in ("kept_blocks", "visible_blocks", "gated_candidates", "gated_kept"))
    # 5 gate tiles of 64 queries x 3 blocks, causal: 1 + 1 + 2 + 2 + 3 = 9 visible per head; only
    # block 1 of gate tile 4 is gated (the others are diagonal or the sink block 0).
    assert (stats["visible_blocks"], stats["gated_candidates"]) == (18, 2)
    assert stats["kept_blocks"] == 16 + stats["gated_kept"]
    assert stats["density"] == stats["kept_blocks"] / 18
