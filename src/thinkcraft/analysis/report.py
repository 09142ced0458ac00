"""The outputs of `thinkcraft compare`: a JSON of every number, a PNG of the curves, terminal tables (rich)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from thinkcraft.utils.io import atomic_write_json

if TYPE_CHECKING:
    from thinkcraft.analysis.compare import Comparison, CompareConfig


def _num(x: Any) -> Any:
    """JSON-safe number: NaN/inf -> None."""
    x = float(x)
    return x if math.isfinite(x) else None


def _nums(a: np.ndarray) -> list[Any]:
    return [_num(v) for v in np.asarray(a).tolist()]


def _interval(iv: Any) -> dict[str, Any]:
    return {"point": _num(iv.point), "low": _num(iv.low), "high": _num(iv.high)}


def comparison_dict(c: "Comparison", cfg: "CompareConfig") -> dict[str, Any]:
    groups = []
    for name, seeds in c.groups.items():
        metrics = {}
        for metric, per_group in c.results.items():
            r = per_group.get(name)
            if r is None:
                continue
            metrics[metric] = {
                "finals": [{"run": f.run, "seed": f.seed, "final": _num(f.value), "steps": _num(f.steps)} for f in r.finals],
                "n_seeds": len(r.finals),
                "iqm": _interval(r.iqm),
                "mean": _interval(r.mean),
                "curve": None if r.curve is None else {
                    cfg.x_key: _nums(r.curve.x), "mean": _nums(r.curve.mean),
                    "low": _nums(r.curve.low), "high": _nums(r.curve.high),
                },
            }
        fields = {k: seeds[0].config.get(k) for k in c.group_fields}
        runs = [{"run_dir": s.run_dir, "seed_index": s.seed_index, "seed": s.seed} for s in seeds]
        groups.append({"label": name, "fields": fields, "runs": runs, "metrics": metrics})
    return {
        "method": "final = mean over the last final_frac of each seed's steps; IQM and mean with stratified "
                  "percentile bootstrap CIs, probability of improvement (rliable, Agarwal et al. NeurIPS 2021); "
                  "curves linearly interpolated per seed onto a common grid, mean with a bootstrap band",
        "x_key": cfg.x_key, "smooth_steps": cfg.smooth_steps, "final_frac": cfg.final_frac, "bootstrap_samples": cfg.bootstrap_samples,
        "confidence": cfg.confidence, "seed": cfg.seed, "group_fields": c.group_fields,
        "groups": groups,
        "probability_of_improvement": {m: [{"x": d["x"], "y": d["y"], "p": _num(d["point"]), "low": _num(d["low"]),
                                            "high": _num(d["high"])} for d in rows]
                                       for m, rows in c.improvement.items()},
        "warnings": c.warnings,
    }


def write_comparison_json(path: Path, c: "Comparison", cfg: "CompareConfig") -> Path:
    atomic_write_json(path, comparison_dict(c, cfg))
    return path


def x_label(c: "Comparison", cfg: "CompareConfig") -> str:
    if cfg.x_key != "step":
        return cfg.x_key
    env_steps = all("num_envs" in s.config for seeds in c.groups.values() for s in seeds)
    return "environment steps" if env_steps else "step"


def plot_comparison(path: Path, c: "Comparison", cfg: "CompareConfig") -> Path | None:
    """One panel per metric: each group's mean curve, its band shaded; legend = group labels (n seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m, per in c.results.items() if any(r.curve is not None for r in per.values())]
    if not metrics:
        return None
    cols = min(2, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.8 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric in zip(axes.flat, metrics):
        for i, name in enumerate(c.groups):
            r = c.results[metric].get(name)
            if r is None or r.curve is None:
                continue
            col = colors[i % len(colors)]
            cv = r.curve
            if cfg.show_seeds:
                for seed_curve in cv.seeds:
                    ax.plot(cv.x, seed_curve, color=col, lw=0.6, alpha=0.3)
            ax.plot(cv.x, cv.mean, color=col, lw=1.8, label=f"{name} (n={len(cv.seeds)})")
            ax.fill_between(cv.x, cv.low, cv.high, color=col, alpha=0.2, lw=0)
        ax.set_title(metric)
        ax.set_xlabel(x_label(c, cfg))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    fig.suptitle(f"mean over seeds, {cfg.confidence:.0%} bootstrap band", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1e4 else f"{x:.4g}"


def _fmt_interval(iv: Any) -> str:
    return f"{_fmt(iv.point)} [{_fmt(iv.low)}, {_fmt(iv.high)}]"


def print_comparison(c: "Comparison", cfg: "CompareConfig") -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console(width=None if sys.stdout.isatty() else 160)  # logs and pipes: don't wrap at 80 columns
    pct = f"{cfg.confidence:.0%}"
    for metric, per_group in c.results.items():
        t = Table(title=f"{metric}: final = mean over the last {cfg.final_frac:.0%} of each seed's steps")
        for col in ("group", "seeds", "final per seed", f"IQM [{pct} CI]", f"mean [{pct} CI]"):
            t.add_column(col, justify="left" if col in ("group", "final per seed") else "right")
        for name, r in per_group.items():
            finals = " ".join(_fmt(f.value) for f in r.finals[:10]) + (" ..." if len(r.finals) > 10 else "")
            t.add_row(name, str(len(r.finals)), finals, _fmt_interval(r.iqm), _fmt_interval(r.mean))
        out.print(t)
        for d in c.improvement.get(metric, []):
            out.print(f"  P({d['x']} > {d['y']}) = {d['point']:.2f} [{d['low']:.2f}, {d['high']:.2f}]")
