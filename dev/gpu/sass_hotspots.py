"""Where one kernel's warps stall, per SASS instruction: summarises the source page of an ncu report.

On the GPU machine:
  ncu --clock-control none --kernel-name regex:NAME --launch-count 1 --section SourceCounters \
      --section WarpStateStats -o REPORT python3 SCRIPT ...
  python3 dev/gpu/sass_hotspots.py REPORT.ncu-rep [--top 40] [--context 3]

Prints the kernel's totals (warp-stall samples, instructions executed), the samples and executions per opcode,
and the instructions with the most samples, each with its neighbours (the SASS text around a stall says what it
waits for). Reads `ncu -i REPORT --page source --csv --print-source sass`; the column names are found by
substring, so the script follows ncu's renames within a release family.
"""
import argparse
import collections
import csv
import io
import subprocess
import sys


def column(header, *parts):
    for i, name in enumerate(header):
        low = name.lower()
        if all(p in low for p in parts):
            return i
    return None


def number(s):
    try:
        return float(s.replace(",", "")) if s not in ("", None) else 0.0
    except ValueError:
        return 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--context", type=int, default=3)
    ap.add_argument("--ncu", default="ncu")
    a = ap.parse_args(argv)
    text = subprocess.run([a.ncu, "-i", a.report, "--page", "source", "--csv", "--print-source", "sass"],
                          check=True, capture_output=True, text=True).stdout
    rows = [r for r in csv.reader(io.StringIO(text)) if r]
    hi = next((i for i, r in enumerate(rows) if column(r, "source") is not None and column(r, "sampl") is not None),
              None)
    if hi is None:
        print("no source page with sampling columns in the report; first lines:\n" + "\n".join(text.splitlines()[:5]))
        return 1
    header, body = rows[hi], rows[hi + 1:]
    c_src = column(header, "source")
    c_addr = column(header, "address")
    c_all = column(header, "sampl", "all") or column(header, "sampl")
    c_nis = column(header, "sampl", "not")
    c_exe = column(header, "instructions executed") or column(header, "executed")
    print("columns:", "; ".join(h for h in header[:12]))
    ins = []
    for r in body:
        if len(r) <= max(c for c in (c_src, c_all) if c is not None):
            continue
        src = r[c_src].strip()
        ins.append((r[c_addr] if c_addr is not None else "", src, number(r[c_all]),
                    number(r[c_nis]) if c_nis is not None else 0.0, number(r[c_exe]) if c_exe is not None else 0.0))
    total = sum(x[2] for x in ins) or 1.0
    total_exe = sum(x[4] for x in ins)
    print(f"instructions in the kernel {len(ins)}, stall samples {total:.0f}, warp instructions executed {total_exe:.0f}")
    per_op = collections.defaultdict(lambda: [0.0, 0.0])
    for _, src, s, _, e in ins:
        op = src.split()[0] if src else "?"
        if op.startswith("@"):
            op = src.split()[1] if len(src.split()) > 1 else op
        op = op.split(".")[0]
        per_op[op][0] += s
        per_op[op][1] += e
    print("\nper opcode: samples %, executed %")
    for op, (s, e) in sorted(per_op.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"  {op:14s} {100 * s / total:6.2f} {100 * e / max(total_exe, 1):6.2f}")
    order = sorted(range(len(ins)), key=lambda i: -ins[i][2])[:a.top]
    print(f"\ntop {a.top} instructions by samples (address, samples %, not issued %, executed; neighbours)")
    for i in order:
        print(f"--- {ins[i][0]}  {100 * ins[i][2] / total:.2f} %  (not issued {100 * ins[i][3] / total:.2f} %)")
        for j in range(max(0, i - a.context), min(len(ins), i + 2)):
            mark = ">>" if j == i else "  "
            print(f"   {mark} {ins[j][0]:>6s} {100 * ins[j][2] / total:5.2f} {ins[j][4]:10.0f}  {ins[j][1][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
