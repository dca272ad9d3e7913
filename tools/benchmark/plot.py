"""benchmarks.png: per config, eager / autocudagraph / raw replay / torch, both timing modes.

Run by report.plot_in_child in a process of its own that imports neither Paddle nor torch:
Paddle 2.6's libraries and matplotlib's PNG writer crashed together in one process (seen on the CPU build).
"""

import json

from .timing import MODES

LABELS = {"paddle_eager": "Paddle eager", "autocudagraph": "autocudagraph (default)",
          "autocudagraph_step": "autocudagraph_step (whole step)", "raw_replay": "raw replay (floor)",
          "autocudagraph_chain_calls_false": "autocudagraph, chain_calls=False",
          "torch_eager": "torch eager", "torch_graphed": "torch make_graphed", "torch_raw_replay": "torch raw replay"}
PLOTTED = list(LABELS)


def draw(plt, rows):
    """The figure: one panel per timing mode, bars per config, the legend above the panels (it
    never covers a bar), the y axis saying lower is better."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(len(MODES), 1, figsize=(max(8, 1.6 * len(configs)), 8.8), sharex=True)
    width = 0.8 / len(PLOTTED)
    for ax, mode in zip(axes, MODES):
        by_config = {r["config"]: r for r in rows if r["mode"] == mode}
        for i, name in enumerate(PLOTTED):
            values = [by_config[c].get(f"{name}_us") or float("nan") if c in by_config else float("nan")
                      for c in configs]
            ax.bar([k + (i - (len(PLOTTED) - 1) / 2) * width for k in range(len(configs))], values, width,
                   label=LABELS[name], hatch="//" if name.startswith("torch") else None)
        ax.set_yscale("log")
        ax.set_ylabel("us per step (log scale)\nlower is better")
        ax.set_title(f"{mode}: {'N steps, one sync' if mode == 'throughput' else 'a sync after every step'}")
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xticks(range(len(configs)))
    axes[-1].set_xticklabels(configs, rotation=20, ha="right")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.suptitle(f"{rows[0]['gpu']}, Paddle {rows[0]['paddle']}" + (" - SMOKE RUN, not a benchmark" if rows[0]["smoke"] else ""))
    # Above the panels, below the title: outside every axes, so no bar is ever covered.
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.955), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


def main(rows_json, path):
    """Draws ``path`` from benchmarks.json; exit 3 with the reason on stdout when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("skipped: matplotlib is not installed (pip install -e .[bench])")
        return 3
    with open(rows_json) as fh:
        rows = json.load(fh)
    if not rows:
        print("skipped: no rows")
        return 3
    fig = draw(plt, rows)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return 0


