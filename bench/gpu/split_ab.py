"""The split tail against whole units, in one process (the launcher reads SPARSE_ATTN_HOPPER_SPLIT per call).

For each case: the split output against the whole one (relative error; bitwise repeat of the split),
then interleaved samples of 10 back-to-back launches of each variant, alternating sample by sample so
the card's drift falls on both alike. Cases: tile16 at Lk 4K / 16K / 64K, dense D = 128 at 4K and 16K,
dense D = 64 at 4K, and a dense problem with fewer units than SMs (B 1, H 2, 4K: 64 units).

Usage: python3 split_ab.py --lib libsa_bench.so --out result.json
"""
import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import BLOCK, Ours, load_lib, make_lists, random_qkv, relerr, sample  # noqa: E402


def set_split(on):
    os.environ["SPARSE_ATTN_HOPPER_SPLIT"] = "force" if on else "0"


def compare(name, call, useful, rows, samples):
    set_split(False)
    whole = call().clone()
    set_split(True)
    split = call().clone()
    again = call().clone()
    err = relerr(split, whole)
    if not err < 2e-2:
        sys.exit("%s: split against whole, relative error %.3g" % (name, err))
    row = {"case": name, "relerr_split_vs_whole": err, "repeat_identical": bool(torch.equal(split, again))}
    ts = {"split": [], "whole": []}
    for variant in ts:
        set_split(variant == "split")
        for _ in range(3):
            call()
    for i in range(samples):
        for variant in (("split", "whole") if i % 2 == 0 else ("whole", "split")):
            set_split(variant == "split")
            ts[variant].append(sample(call))
    for variant, t in ts.items():
        t.sort()
        row[variant + "_ms"] = t[len(t) // 2]
        row[variant + "_tflops"] = useful / row[variant + "_ms"] / 1e9
    rows.append(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=40)
    args = ap.parse_args()
    fn = load_lib(args.lib)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    rows = []
    B, Hq, Hkv, D, Lq, nsel = 2, 16, 1, 128, 4096, 16
    for Lk, pattern in [(4096, "independent"), (16384, "pairs"), (65536, "independent")]:
        q, k, v = random_qkv(B, Lq, Lk, Hq, Hkv, D, dev)
        idx, cnt = make_lists(B, Lq // BLOCK, Lk // BLOCK, nsel, pattern, gen, dev)
        ours = Ours(fn, q, k, v, False, idx, cnt)
        ours(trusted=False)
        compare("tile16 %s %dK" % (pattern, Lk // 1024), lambda: ours(trusted=True),
                4 * D * B * Hq * (Lq // BLOCK) * nsel * BLOCK * BLOCK, rows, args.samples)
    for b, h, d, L in [(2, 16, 128, 4096), (2, 16, 128, 16384), (2, 16, 64, 4096), (1, 2, 128, 4096)]:
        q, k, v = random_qkv(b, L, L, h, h, d, dev)
        ours = Ours(fn, q, k, v, False)
        compare("dense B%d H%d D%d %dK" % (b, h, d, L // 1024), lambda: ours(), 4 * d * b * h * L * L, rows, args.samples)
    with open(args.out, "w") as f:
        json.dump({"meta": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
                   "rows": rows}, f, indent=1)
    print("%-26s %9s %9s %8s %8s %7s %s" % ("case", "split ms", "whole ms", "split TF", "whole TF", "gain", "relerr / repeat"))
    for r in rows:
        print("%-26s %9.4f %9.4f %8.1f %8.1f %6.1f%% %.1e %s" % (
            r["case"], r["split_ms"], r["whole_ms"], r["split_tflops"], r["whole_tflops"],
            100 * (r["whole_ms"] / r["split_ms"] - 1), r["relerr_split_vs_whole"], r["repeat_identical"]))


if __name__ == "__main__":
    main()
