"""Learning-curve PNGs from metrics.jsonl (matplotlib, headless Agg backend)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from thinkcraft.utils.metrics import read_metrics


def plot_curves(
    metrics_path: str | os.PathLike,
    out_png: str | os.PathLike,
    keys: Sequence[str],
    title: str = "",
    x_key: str = "step",
) -> Path | None:
    """One subplot per key that appears in the metrics; returns the PNG path (None if nothing to plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    present = [k for k in keys if any(k in r for r in recs)]
    if not present:
        return None
    fig, axes = plt.subplots(len(present), 1, figsize=(7, 2.6 * len(present)), squeeze=False)
    for ax, k in zip(axes[:, 0], present):
        xs = [r[x_key] for r in recs if k in r]
        ys = [r[k] for r in recs if k in r]
        ax.plot(xs, ys, marker="." if len(xs) < 50 else None)
        ax.set_ylabel(k)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("environment steps" if x_key == "step" else x_key)
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
