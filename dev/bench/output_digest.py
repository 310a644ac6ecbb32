"""Digests of the GPU executors' outputs on fixed seeded inputs, to show that a change leaves them bit for bit.

Runs dense (causal and not), tile_sparse (16 random blocks per Q tile, per KV head), query_sparse (16 random
blocks per query, f32 and bf16 partials, the automatic merge window) and token_sparse (256 random keys per
query) on inputs made on the CPU from fixed seeds, and prints one line per case: the SHA-256 (first 16 hex
digits) of out and of lse. Run it with two builds of the package and compare the outputs with diff:

    PYTHONPATH=<package built from main> python3 dev/bench/output_digest.py > before.txt
    PYTHONPATH=<package built from the change> python3 dev/bench/output_digest.py > after.txt
    diff before.txt after.txt && echo identical

Shapes: tile16 (B 2, L 4096 x Lk 16384, 16 heads, GQA 1, D 128), dense 4K (B 1, 16 heads), query16of32
(B 8, L 4096, 16 query heads on 1 KV head) and query-long (L 32768, 32 on 8), D 128, bf16. Needs torch with a
CUDA device.
"""

import hashlib

import torch

import sparse_attn as sa


def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def inputs(seed, B, Lq, Lk, Hq, Hkv, D=128):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, L, H, D, generator=g).to(torch.bfloat16).cuda()
               for L, H in ((Lq, Hq), (Lk, Hkv), (Lk, Hkv)))
    return q, k, v, g


def random_blocks(g, rows, Tk, n):
    """n distinct random blocks of Tk per row, ascending, as int32 [rows, n]."""
    return torch.rand(rows, Tk, generator=g).argsort(dim=1)[:, :n].sort(dim=1).values.to(torch.int32)


def main():
    lines = []

    def record(name, out, lse):
        torch.cuda.synchronize()
        lines.append(f"{name:36s} out {digest(out)} lse {digest(lse)}")

    for causal in (False, True):
        q, k, v, _ = inputs(1, 1, 4096, 4096, 16, 16)
        record(f"dense 4K causal={causal}", *sa.dense(q, k, v, causal=causal, return_lse=True))

    B, Lq, Lk, H = 2, 4096, 16384, 16
    q, k, v, g = inputs(2, B, Lq, Lk, H, H)
    Tq, Tk = Lq // 128, Lk // 128
    idx = random_blocks(g, B * H * Tq, Tk, 16).view(B, H, Tq, 16).cuda()
    cnt = torch.full((B, H, Tq), 16, dtype=torch.int32).cuda()
    record("tile16", *sa.tile_sparse(q, k, v, idx, cnt, return_lse=True))

    for name, (B, L, Hq, Hkv, blocks) in {"query16of32": (8, 4096, 16, 1, 16),
                                           "query-long": (1, 32768, 32, 8, 16)}.items():
        q, k, v, g = inputs(3, B, L, L, Hq, Hkv)
        lists = random_blocks(g, B * Hkv * L, L // 128, blocks)
        lists = lists[:, torch.randperm(blocks, generator=g)].reshape(B, Hkv, L, blocks).cuda()
        for partials in ("f32", "bf16"):
            record(f"{name} {partials} partials", *sa.query_sparse(q, k, v, lists, partials=partials, return_lse=True))

    q, k, v, g = inputs(4, 1, 4096, 4096, 16, 2)
    tokens = random_blocks(g, 2 * 4096, 4096, 256).view(1, 2, 4096, 256).cuda()
    record("token_sparse 256 of 4K", *sa.token_sparse(q, k, v, tokens, return_lse=True))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
