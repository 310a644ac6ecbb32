"""Invalid selections (ids out of range, unsorted, duplicates, counts over Kmax or negative, stray
bits) through the executors and conversions on the GPU with trusted=False, all in this one process so
that compute-sanitizer sees every kernel:

    compute-sanitizer --tool memcheck python tests/gpu/bad_selections.py [--cases 400]

Each case must raise an error naming the operator and the argument; exits 1 when one is accepted or
its error is vague. Needs the sparse_attn package and torch with a CUDA device. The cases are those
of the campaign's invalid_selections category (tests/campaign/run_campaign.py)."""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "campaign"))
import run_campaign as rc  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=400, help="invalid-selection cases generated (trusted ones skipped)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch
    import sparse_attn as sa
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    bad, ran = [], 0
    for i in range(args.cases):
        case = rc.make_case(args.seed, i, "cuda", ["invalid_selections"])
        if case.expect != "refuse":  # trusted=True: unchecked by contract
            continue
        ran += 1
        try:
            case.run()
            torch.cuda.synchronize()
            sa.check_device_faults()
            bad.append(f"#{i} {case.op} [{case.what}]: accepted")
        except rc.Refused as e:
            bad.append(f"#{i} {case.op} [{case.what}]: {e}")
        except Exception as e:  # the error being judged
            message = str(e)
            if not (message.startswith(case.op) and rc.names_argument(message, case.names)):
                bad.append(f"#{i} {case.op} [{case.what}]: vague {type(e).__name__}: {message}")
    torch.cuda.synchronize()
    print(f"{ran} invalid selections with trusted=False, {len(bad)} not refused clearly")
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
