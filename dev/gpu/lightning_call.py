"""Two lightning_select calls (token form, fp8, causal, 64 index heads, Di 128, top-2048) at Lq = Lk = L, for ncu.

python3 dev/gpu/lightning_call.py <directory holding the sparse_attn package> L [precision]"""
import sys

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402

import sparse_attn as sa  # noqa: E402

L, HI, Di, top_k = int(sys.argv[2]), 64, 128, 2048
prec = sys.argv[3] if len(sys.argv) > 3 else "fp8_e4m3"
g = torch.Generator(device="cuda").manual_seed(1)
q = torch.randn(1, L, HI, Di, device="cuda", dtype=torch.bfloat16, generator=g)
k = torch.randn(1, L, Di, device="cuda", dtype=torch.bfloat16, generator=g)
w = torch.randn(1, L, HI, device="cuda", dtype=torch.float32, generator=g)
idx = torch.empty(1, 1, L, top_k, device="cuda", dtype=torch.int32)
for _ in range(2):
    sa.lightning_select(q, w, k, top_k=top_k, causal=True, precision=prec, out=idx)
torch.cuda.synchronize()
