"""Three token_max_select calls per precision at the tile16 shape (TileLists, Lk 16K), for ncu.

python3 dev/gpu/token_max_call.py <directory holding the sparse_attn package> fp8_e4m3 [bf16 ...]"""
import sys

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402

import sparse_attn as sa  # noqa: E402

B, Lq, Lk, Hkv, D, top_k = 2, 4096, 16384, 1, 128, 16
g = torch.Generator(device="cuda").manual_seed(1)
qidx = torch.randn(B, Lq, Hkv, D, device="cuda", generator=g).to(torch.bfloat16)
kidx = torch.randn(B, Lk, 1, D, device="cuda", generator=g).to(torch.bfloat16)
Tq = (Lq + 127) // 128
out = (torch.empty(B, Hkv, Tq, top_k, dtype=torch.int32, device="cuda"),
       torch.empty(B, Hkv, Tq, dtype=torch.int32, device="cuda"))
for prec in sys.argv[2:]:
    for _ in range(3):
        sa.token_max_select(qidx, kidx, top_k=top_k, causal=False, format="tile", out=out, precision=prec)
torch.cuda.synchronize()
