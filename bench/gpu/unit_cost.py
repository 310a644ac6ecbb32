"""Per-block and per-unit cost of the Q-centric kernel, for timing a change against its parent.

tile16's shape (B 2, Hq 16, Hkv 1, D 128, Lq 4K, Lk 16K) with n = 4, 8, 16, 32, 64 blocks per Q tile and
the split tail off (SPARSE_ATTN_HOPPER_SPLIT=0), so the busiest CTA runs 8 whole units. Each time is
the median of 20 samples of 10 back-to-back launches, the n interleaved sample by sample; the fit
t / 8 = a n + b gives a (us per block: the main loop) and b (us per unit: the item boundary, the
epilogue and the launch's share). Two builds of the library cannot share a process: run one process per
build, alternating builds, several rounds (docs/notes/hopper.md, "Where an item boundary goes").

Usage: python3 unit_cost.py --lib libsa_bench.so --out result.json
"""
import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import BLOCK, Ours, load_lib, make_lists, random_qkv, relerr, sample  # noqa: E402

NS = [4, 8, 16, 32, 64]
UNITS_PER_CTA = 8  # 1024 units on 132 CTAs: the busiest runs 8


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=20)
    args = ap.parse_args()
    os.environ["SPARSE_ATTN_HOPPER_SPLIT"] = "0"
    fn = load_lib(args.lib)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, Lq, Lk = 2, 16, 1, 128, 4096, 16384
    q, k, v = random_qkv(B, Lq, Lk, Hq, Hkv, D, dev)
    calls = {}
    for n in NS:
        idx, cnt = make_lists(B, Lq // BLOCK, Lk // BLOCK, n, "independent", gen, dev)
        o = Ours(fn, q, k, v, False, idx, cnt)
        out = o(trusted=False).clone()
        # Verified before it is timed: the first two Q tiles of batch 0 against attention computed in
        # float32 over the same blocks.
        rows = 2 * BLOCK
        allowed = torch.zeros(rows, Lk, dtype=torch.bool, device=dev)
        for t in range(2):
            for j in idx[0, 0, t, : int(cnt[0, 0, t])].tolist():
                allowed[t * BLOCK:(t + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = True
        qf, kf, vf = q[0, :rows].float().transpose(0, 1), k[0, :, 0].float(), v[0, :, 0].float()
        s = (qf @ kf.T) / D ** 0.5
        ref = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ vf
        err = relerr(out[0, :rows].transpose(0, 1), ref)
        if not err < 2e-2:
            sys.exit("n = %d: relative error %.3g against the float32 reference" % (n, err))
        calls[n] = o
    for o in calls.values():
        for _ in range(3):
            o(trusted=True)
    times = {n: [] for n in NS}
    for _ in range(args.samples):
        for n, o in calls.items():
            times[n].append(sample(lambda: o(trusted=True)))
    med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    ys = [med[n] * 1000 / UNITS_PER_CTA for n in NS]
    mx, my = sum(NS) / len(NS), sum(ys) / len(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(NS, ys)) / sum((x - mx) ** 2 for x in NS)
    b = my - a * mx
    res = {"meta": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "lib": args.lib,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
           "median_ms": {str(n): med[n] for n in NS}, "fit": {"us_per_block": a, "us_per_unit": b}}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    useful = {n: 4 * D * B * Hq * (Lq // BLOCK) * n * BLOCK * BLOCK for n in NS}
    for n in NS:
        print("n = %3d  %.4f ms  %6.1f TFLOP/s" % (n, med[n], useful[n] / med[n] / 1e9))
    print("fit: %.3f us per block + %.2f us per unit" % (a, b))


if __name__ == "__main__":
    main()
