"""`thinkcraft compare RUN_DIR...`: learning curves and final performance of groups of runs, with confidence.

    thinkcraft compare runs/ppo-* --metric episode/return achievements/mean_rate
    thinkcraft compare runs/a runs/b --label runs/a=baseline --label runs/b=new

1. Read each run directory's config.json and metrics.jsonl; split multi-seed directories by `seed_index`
   (analysis.runs documents the layout); pool seeds into groups (the config fields that differ, or
   `--group-by`, or `--label`).
2. Curves: each seed's (step, value) series is linearly interpolated onto one grid per group -
   `--grid-points` evenly spaced steps over the range every seed of the group covers (no extrapolation:
   a seed that stopped early shortens its group's curve; runs log at different steps, e.g. Baselines per
   update and thinkcraft per chunk of updates, so raw points would not line up). The line is the mean over
   seeds, the band its 95% percentile bootstrap over seeds. `--smooth-steps W` first averages each seed's
   values over a trailing window of W steps (a run logged per update next to one logged per chunk).
3. Final performance: per seed, the mean of the values logged in the last `--final-frac` of its steps;
   per group, the interquartile mean (IQM) and the mean of those finals with 95% stratified percentile
   bootstrap CIs, and the probability of improvement P(X > Y) between groups - rliable's method (Agarwal et
   al., "Deep Reinforcement Learning at the Edge of the Statistical Precipice", NeurIPS 2021; see
   analysis.stats).
4. Write a PNG (a panel per metric), a JSON (groups, per-seed finals, intervals, curves) and print tables.
"""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import tyro

from thinkcraft.analysis.runs import (
    SeedRun, assign_groups, available_metrics, describe_metrics, expand_run_dirs, group_warnings, load_seed_runs,
    parse_labels,
)
from thinkcraft.analysis.stats import (
    Interval, bootstrap_ci, bootstrap_mean_band, common_grid, final_value, interpolate_to_grid,
    probability_of_improvement_ci, stat_iqm, stat_mean, trailing_mean,
)
from thinkcraft.utils.errors import UserError, check


@dataclass
class CompareConfig:
    """Compare groups of runs: curves with 95% bootstrap bands, final IQM and mean with 95% CIs (rliable)."""

    run_dirs: tyro.conf.Positional[list[str]]
    """Run directories or glob patterns (quote them to let thinkcraft expand them: 'runs/ppo-*')."""
    metric: list[str] = field(default_factory=lambda: ["episode/return"])
    """Metrics to compare (several: one panel and one table each); glob patterns match logged names ('achievements/*')."""
    group_by: str | None = None
    """Comma-separated config fields that define the groups (default: every field that differs between runs)."""
    label: tyro.conf.UseAppendAction[list[str]] = field(default_factory=list)
    """DIR=name: put this run directory in the group `name` (repeat the flag; dirs sharing a name pool)."""
    final_frac: float = 0.1
    """Final performance of a seed = mean of its values over the last this fraction of its steps."""
    bootstrap_samples: int = 2000
    """Bootstrap resamples for every confidence interval and band."""
    confidence: float = 0.95
    """Confidence level of the intervals and bands."""
    smooth_steps: float = 0.0
    """Curves only: average each seed's values over a trailing window of this many steps before
    interpolating (e.g. one logging chunk, to compare a run logged per update with one logged per chunk)."""
    grid_points: int = 100
    """Points of the common step grid the seeds' curves are interpolated onto."""
    x_key: str = "step"
    """Record field for the x axis (step: env steps; llm-policy runs: learner steps; or time_s)."""
    seed: int = 0
    """Seed of the bootstrap resampling (same seed, same intervals)."""
    out: str | None = None
    """Output directory (default: ./compare-<time>)."""
    show_seeds: bool = False
    """Also draw each seed's interpolated curve, thin."""
    plot: bool = True
    """Write compare.png (a panel per metric)."""

    def __post_init__(self) -> None:
        check(len(self.run_dirs) > 0, "run_dirs", "give at least one run directory or glob")
        check(len(self.metric) > 0, "metric", "give at least one metric")
        check(0.0 <= self.final_frac <= 1.0, "final_frac", f"must be in [0, 1], got {self.final_frac}")
        check(self.bootstrap_samples >= 1, "bootstrap_samples", f"must be >= 1, got {self.bootstrap_samples}")
        check(0.0 < self.confidence < 1.0, "confidence", f"must be in (0, 1), got {self.confidence}")
        check(self.smooth_steps >= 0, "smooth_steps", f"must be >= 0, got {self.smooth_steps}")
        check(self.grid_points >= 2, "grid_points", f"must be >= 2, got {self.grid_points}")

    @property
    def group_fields(self) -> list[str]:
        return [f.strip() for f in (self.group_by or "").split(",") if f.strip()]


class Curve(NamedTuple):
    """A group's curve of one metric on its grid: mean over seeds and the bootstrap band; `seeds` (S, G)."""

    x: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    seeds: np.ndarray


class Final(NamedTuple):
    run: str  # run dir, [seed_index] for a multi-seed dir
    seed: int | None
    value: float
    steps: float  # the seed's last x (its length)


class GroupResult(NamedTuple):
    """One group's numbers for one metric."""

    finals: list[Final]
    iqm: Interval
    mean: Interval
    curve: Curve | None


class Comparison(NamedTuple):
    groups: dict[str, list[SeedRun]]
    group_fields: list[str]
    results: dict[str, dict[str, GroupResult]]  # metric -> group -> result
    improvement: dict[str, list[dict[str, Any]]]  # metric -> [{x, y, p, low, high}]
    warnings: list[str]


def expand_metrics(patterns: list[str], available: list[str]) -> list[str]:
    """Metric names, glob patterns (`achievements/*`) expanded over the logged names, in order, once each."""
    out: list[str] = []
    for p in patterns:
        names = fnmatch.filter(available, p) if any(c in p for c in "*?[") else [p] if p in available else []
        if not names:
            raise UserError(f"--metric {p}: no run logged it; available: {describe_metrics(available)}")
        out += [n for n in names if n not in out]
    return out


def group_result(seeds: list[SeedRun], metric: str, cfg: CompareConfig) -> GroupResult | None:
    """Finals, IQM / mean with CIs and the gridded curve of `metric` over a group's seeds (None: no seed has it)."""
    series = [(s, *s.series(metric, cfg.x_key)) for s in seeds]
    series = [(s, x, y) for s, x, y in series if len(x)]
    if not series:
        return None
    finals = [Final(s.name, s.seed, final_value(x, y, cfg.final_frac), float(x.max())) for s, x, y in series]
    values = np.array([f.value for f in finals])
    kw = dict(reps=cfg.bootstrap_samples, confidence=cfg.confidence, seed=cfg.seed)
    curve = None
    grid = common_grid([x for _, x, _ in series], cfg.grid_points)
    if len(grid):
        per_seed = np.stack([interpolate_to_grid(x, trailing_mean(x, y, cfg.smooth_steps), grid)
                             for _, x, y in series])
        curve = Curve(grid, *bootstrap_mean_band(per_seed, **kw), seeds=per_seed)
    return GroupResult(finals, bootstrap_ci(values, stat_iqm, **kw), bootstrap_ci(values, stat_mean, **kw), curve)


def compare_groups(groups: dict[str, list[SeedRun]], group_fields: list[str], cfg: CompareConfig) -> Comparison:
    """The numbers behind every output (pure given the loaded runs)."""
    warnings = group_warnings(groups)
    all_runs = [s for seeds in groups.values() for s in seeds]
    results: dict[str, dict[str, GroupResult]] = {}
    improvement: dict[str, list[dict[str, Any]]] = {}
    for metric in expand_metrics(cfg.metric, available_metrics(all_runs)):
        results[metric] = {}
        for name, seeds in groups.items():
            missing = [s.name for s in seeds if metric not in s.metric_names]
            if missing:
                warnings.append(f"{metric}: {len(missing)} seed(s) of '{name}' never logged it: {', '.join(missing)}")
            r = group_result(seeds, metric, cfg)
            if r is None:
                continue
            if r.curve is None:
                warnings.append(f"{metric}: the seeds of '{name}' cover no common {cfg.x_key} range; no curve")
            results[metric][name] = r
        names = list(results[metric])
        improvement[metric] = [
            {"x": a, "y": b, **probability_of_improvement_ci(
                np.array([f.value for f in results[metric][a].finals]),
                np.array([f.value for f in results[metric][b].finals]),
                reps=cfg.bootstrap_samples, confidence=cfg.confidence, seed=cfg.seed)._asdict()}
            for i, a in enumerate(names) for b in names[i + 1:]
        ]
    return Comparison(groups, group_fields, results, improvement, warnings)


def load_groups(cfg: CompareConfig) -> tuple[dict[str, list[SeedRun]], list[str], list[str]]:
    """(groups, the fields that define them, warnings) from the command line's run dirs."""
    runs: list[SeedRun] = []
    dirs, warnings = expand_run_dirs(cfg.run_dirs)
    for d in dirs:
        seeds, w = load_seed_runs(d)
        runs += seeds
        warnings += w
    labels = parse_labels(cfg.label)
    unknown = set(labels) - {str(Path(r.run_dir).resolve()) for r in runs}
    if unknown:
        raise UserError(f"--label names directories that are not among the runs: {', '.join(sorted(unknown))}")
    groups, fields_ = assign_groups(runs, cfg.group_fields, labels)
    return groups, fields_, warnings


def run(cfg: CompareConfig) -> dict[str, Any]:
    from thinkcraft.analysis.report import plot_comparison, print_comparison, write_comparison_json
    from thinkcraft.utils.progress import console

    groups, fields_, warnings = load_groups(cfg)
    comparison = compare_groups(groups, fields_, cfg)
    comparison.warnings[:0] = warnings
    out = Path(cfg.out or f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    json_path = write_comparison_json(out / "compare.json", comparison, cfg)
    png_path = plot_comparison(out / "compare.png", comparison, cfg) if cfg.plot else None
    print_comparison(comparison, cfg)
    for w in comparison.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")
    console.print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    return {"out_dir": str(out), "json": str(json_path), "png": str(png_path) if png_path else None}
