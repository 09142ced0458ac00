"""Figures: one helper that saves every PNG thinkcraft writes, and learning curves from metrics.jsonl."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from thinkcraft.utils.metrics import read_metrics


def pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend (no display needed; safe from worker processes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out_png: str | os.PathLike, dpi: int = 110) -> Path:
    """Lay out, write atomically (a reader never sees half a PNG) and close `fig`; returns the path."""
    from thinkcraft.utils.io import atomic_path

    out_png = Path(out_png)
    fig.tight_layout()
    try:
        with atomic_path(out_png, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=dpi, format="png")
    finally:
        pyplot().close(fig)
    return out_png


def plot_curves(
    metrics_path: str | os.PathLike,
    out_png: str | os.PathLike,
    keys: Sequence[str],
    title: str = "",
    x_key: str = "step",
    x_label: str = "environment steps",
) -> Path | None:
    """One subplot per key that appears in the metrics, against `x_key` (labelled `x_label`), one line per
    seed of a multi-seed run (records carrying `seed_index`); returns the PNG path (None if nothing to plot)."""
    recs = read_metrics(metrics_path)
    present = [k for k in keys if any(k in r for r in recs)]
    if not present:
        return None
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(present), 1, figsize=(7, 2.6 * len(present)), squeeze=False)
    seeds = sorted({r.get("seed_index") for r in recs}, key=lambda i: -1 if i is None else i)
    for ax, k in zip(axes[:, 0], present):
        for seed in seeds:
            xs = [r[x_key] for r in recs if k in r and r.get("seed_index") == seed]
            ys = [r[k] for r in recs if k in r and r.get("seed_index") == seed]
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=None if seed is None else f"seed {seed}")
        if len(seeds) > 1:
            ax.legend(fontsize="small")
        ax.set_ylabel(k)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and updates are counts
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel(x_label)
    if title:
        axes[0, 0].set_title(title)
    return save_figure(fig, out_png)
