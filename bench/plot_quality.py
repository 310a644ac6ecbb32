#!/usr/bin/env python3
"""Plots selection quality against budget from a `sparse-attn eval --json` file.

Usage:
    pip install matplotlib
    sparse-attn eval --synthetic --selector all --budget 2,4,8,16,32 --json bench/results/quality_cpu.json
    python3 bench/plot_quality.py bench/results/quality_cpu.json -o bench/results/quality_cpu.png

Three panels share the budget axis (KV blocks per Q tile or per query; token selections keep
128 keys per block of budget): the mean fraction of dense attention mass kept, the output
relative error against dense attention, and, when the input has planted needles, the fraction of
needle keys found. One line per selector and selection format; the oracles are dashed.
"""

import argparse
import json
import math
import sys


def series(results):
    """{(selector, selection): [result rows sorted by budget]}, in the order the file lists them."""
    out = {}
    for r in results:
        out.setdefault((r["selector"], r["selection"]), []).append(r)
    for rows in out.values():
        rows.sort(key=lambda r: r["budget"])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="output of sparse-attn eval --json")
    parser.add_argument("-o", "--output", help="PNG to write (default: the JSON path with .png)")
    args = parser.parse_args(argv)

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_quality.py needs matplotlib: pip install matplotlib")

    with open(args.json) as f:
        data = json.load(f)
    results = data.get("results")
    if not results:
        sys.exit(f"{args.json}: no 'results' (is it the output of sparse-attn eval --json?)")
    output = args.output or (args.json[:-5] if args.json.endswith(".json") else args.json) + ".png"

    cfg = data.get("config", {})
    has_needles = any(r.get("needle_recall") is not None for r in results)
    panels = 3 if has_needles else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 5.6), constrained_layout=True)

    styles = {"TileLists": "o", "QueryLists": "s", "TokenLists": "^"}
    names = sorted({r["selector"] for r in results if not r.get("oracle")})
    cmap = plt.get_cmap("tab10")
    colour = {n: cmap(i % 10) for i, n in enumerate(names)}
    colour["oracle"] = "black"

    budgets = sorted({r["budget"] for r in results})
    for (name, selection), rows in series(results).items():
        oracle = rows[0].get("oracle", False)
        x = [r["budget"] for r in rows]
        style = dict(
            marker=styles.get(selection, "x"),
            linestyle="--" if oracle else "-",
            color=colour.get(name, "grey"),
            linewidth=1.2 if oracle else 1.6,
            markersize=5,
            label=f"{name} ({selection})",
        )
        axes[0].plot(x, [100.0 * r["kept_mass_mean"] for r in rows], **style)
        err = [r["out_rel_err"] for r in rows]
        # A selection that keeps everything has error 0, which a log axis cannot show.
        axes[1].plot(x, [e if e is not None and e > 0 and math.isfinite(e) else float("nan") for e in err], **style)
        if has_needles:
            axes[2].plot(x, [100.0 * (r["needle_recall"] or 0.0) for r in rows], **style)

    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets)
        ax.set_xticklabels([str(b) for b in budgets])
        ax.set_xlabel("budget (KV blocks per Q tile / per query; x128 keys for TokenLists)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("kept dense attention mass, mean over queries (%)")
    axes[0].set_title("kept mass")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("||out - dense|| / ||dense||")
    axes[1].set_title("output error vs dense attention")
    if has_needles:
        axes[2].set_ylabel("planted needle keys selected (%)")
        axes[2].set_title("needles found")
        axes[2].set_ylim(-3, 103)

    shape = (
        f"B={cfg.get('batch')} Lq={cfg.get('lq')} Lk={cfg.get('lk')} Hq={cfg.get('heads')} "
        f"Hkv={cfg.get('kv_heads')} D={cfg.get('dim')}{' causal' if cfg.get('causal') else ''}"
    )
    first = cfg.get("eval_first_query", 0)
    fig.suptitle(
        f"sparse-attn eval: {cfg.get('source', '')}\n{shape}, measured on queries {first}..{cfg.get('lq', 0) - 1}",
        fontsize=10,
    )
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    fig.savefig(output, dpi=110)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
