"""Phase times of the pooled selector's scoring CTAs at the tile16 shape (Lk = 16K, top-16, bf16).

Needs a package built from a tree with dev/selectors/pooled_phase_times.patch applied (it is not in the
library): that build stamps %globaltimer in every CTA of both kernels and, after each pooled_select call,
synchronises and prints to stderr, in us from the first scoring CTA's start, the representatives' first
start and last end, and per phase the median and the maximum over the scoring CTAs: [0] CTA start,
[1] after the programmatic wait, [2] first staging landed, [3] the last slab's tasks done, [4] the
chunk's block scores stored, [5] ranked.

  git apply dev/selectors/pooled_phase_times.patch   # then build the Python package
  PYTHONPATH=<built package> python3 dev/selectors/pooled_phases.py
"""
import torch

import sparse_attn as sa

g = torch.Generator(device="cuda").manual_seed(0)
B, Lq, Lk, Hq, D = 2, 4096, 16384, 16, 128
q = torch.randn(B, Lq, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
k = torch.randn(B, Lk, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
idx = torch.empty(B, 1, Lq // 128, 16, dtype=torch.int32, device="cuda")
cnt = torch.empty(B, 1, Lq // 128, dtype=torch.int32, device="cuda")
for r in (1, 4):
    for _ in range(3):  # the first call loads the module
        sa.pooled_select(q, k, top_k=16, representatives=r, out=(idx, cnt))
torch.cuda.synchronize()
