"""`thinkcraft data inspect <dir>` and `thinkcraft data export <dir> --format jsonl`."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

from thinkcraft.utils.errors import check


@dataclass
class InspectConfig:
    """Summarise a trajectory store: counts, rewards, lengths, tokens, errors, policy versions, file sizes.

    Steps are numbered as the run's metrics.jsonl numbers them: a trajectory's learner step is the update
    that trains on it (its metrics line), its policy version the number of updates behind the policy that
    sampled it, so an on-policy trajectory has lag 1."""

    dir: tyro.conf.Positional[str]
    """The store directory (or one .parquet file of it)."""
    plot: bool = False
    """Also write a PNG of histograms (total reward, turns and tokens per trajectory)."""
    plot_path: str | None = None
    """Where to write the PNG (default: <dir>/inspect.png)."""
    max_files_shown: int = 20
    """List at most this many files in the per-file table (the largest ones); 0 hides it."""
    json: bool = False
    """Print the summary as JSON instead of tables."""

    def __post_init__(self) -> None:
        check(self.max_files_shown >= 0, "max_files_shown", f"must be >= 0, got {self.max_files_shown}")
        check(self.plot_path is None or self.plot_path.endswith(".png"), "plot_path", f"must end in .png, got {self.plot_path!r}")


@dataclass
class ExportConfig:
    """Write a store's episodes as JSON lines, one trajectory per line, for people to read."""

    dir: tyro.conf.Positional[str]
    """The store directory (or one .parquet file of it)."""
    format: Literal["jsonl"] = "jsonl"
    """Output format."""
    out: str = "-"
    """Output file ('-': standard output). Written atomically."""
    include_tokens: bool = False
    """Also export token ids, logprobs and loss masks (large)."""
    limit: int = 0
    """Export at most this many trajectories (0: all)."""
    run: str | None = None
    """Only this run's partition."""

    def __post_init__(self) -> None:
        check(self.limit >= 0, "limit", f"must be >= 0 (0 = all), got {self.limit}")


def _fmt(x: float, digits: int = 3) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "-"
    if isinstance(x, float) and not x.is_integer():
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return f"{int(x):,}"


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def run_inspect(cfg: InspectConfig):
    from rich.console import Console
    from rich.table import Table

    from thinkcraft.data.summary import plot_summary, summarize_store

    summary, arrays = summarize_store(cfg.dir)
    png = None
    if cfg.plot:
        default = Path(cfg.dir) / "inspect.png" if Path(cfg.dir).is_dir() else Path(cfg.dir).with_suffix(".png")
        png = plot_summary(arrays, cfg.plot_path or default, title=str(cfg.dir))
    if cfg.json:
        d = summary.to_dict()
        d["plot"] = str(png) if png else None
        print(json.dumps(d, indent=2, default=str))
        return summary

    console = Console()
    if not console.is_terminal:  # a file or a pipe: tables as wide as their content, paths not cut at 80 columns
        console.width = 200
    s = summary
    t = Table(title=f"trajectory store {s.root}", show_header=True)
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("trajectories", _fmt(s.num_trajectories))
    t.add_row("files", f"{s.num_files:,} ({_mb(s.total_bytes)})")
    t.add_row("runs", ", ".join(f"{r}: {c:,}" for r, c in s.runs.items()) or "-")
    t.add_row("learner steps (metrics.jsonl steps)", f"{_fmt(s.learner_steps.min)} .. {_fmt(s.learner_steps.max)}")
    t.add_row("truncated", f"{s.truncation_rate:.1%}" if not math.isnan(s.truncation_rate) else "-")
    t.add_row("with env errors", (f"{s.env_error_rate:.1%} ({s.env_errors_total:,} errors)") if not math.isnan(s.env_error_rate) else "-")
    t.add_row("reward > 0 / == 0", f"{s.frac_positive:.1%} / {s.frac_zero:.1%}" if not math.isnan(s.frac_positive) else "-")
    t.add_row("policy versions", f"{s.num_policy_versions} distinct, {_fmt(s.policy_versions.min)} .. {_fmt(s.policy_versions.max)}")
    t.add_row("policy lag (step - version; 1 = on-policy)", f"mean {_fmt(s.policy_lag.mean)}, max {_fmt(s.policy_lag.max)}")
    t.add_row("tokens (metadata total)", _fmt(s.tokens.total))
    t.add_row("wall time (total)", f"{_fmt(s.wall_time_s.total)} s")
    for name, n in s.token_values_stored.items():
        t.add_row(f"{name} stored", _fmt(n))
    t.add_row("corrupt files (skipped)", str(len(s.corrupt)))
    if s.other_version:
        t.add_row("other schema version (skipped)", f"{len(s.other_version)} (version {', '.join(sorted({v for _, v in s.other_version}))})")
    if s.num_foreign:
        t.add_row("non-trajectory .parquet (skipped)", str(s.num_foreign))
    if s.num_stale_tmp:
        t.add_row("temp files of killed writers", str(s.num_stale_tmp))
    console.print(t)

    d = Table(title="per trajectory (file: MB per file)", show_header=True)
    stats = ("mean", "min", "p10", "p50", "p90", "max")
    d.add_column("")
    for col in stats:
        d.add_column(col, justify="right")
    mb = lambda v: v / 1e6  # noqa: E731
    rows = [("reward", s.reward, float), ("turns", s.turns, float), ("tokens", s.tokens, float),
            ("wall s", s.wall_time_s, float), ("file MB", s.file_sizes, mb)]
    for label, dist, conv in rows:
        d.add_row(label, *(_fmt(conv(getattr(dist, k))) for k in stats))
    console.print(d)

    if cfg.max_files_shown and s.files:
        f = Table(title=f"files ({min(cfg.max_files_shown, len(s.files))} largest of {len(s.files)})", show_header=True)
        f.add_column("file")
        f.add_column("trajectories", justify="right")
        f.add_column("size", justify="right")
        for fi in sorted(s.files, key=lambda fi: -fi.size_bytes)[: cfg.max_files_shown]:
            f.add_row(fi.path, f"{fi.rows:,}", _mb(fi.size_bytes))
        console.print(f)
    for path, reason in s.corrupt:
        console.print(f"[yellow]corrupt, skipped:[/yellow] {path} ({reason})", highlight=False)
    for path, v in s.other_version:
        console.print(f"[yellow]schema version {v}, skipped:[/yellow] {path}", highlight=False)
    if png:
        console.print(f"histograms: {png}", highlight=False)
    return summary


def run_export(cfg: ExportConfig) -> int:
    from thinkcraft.data.reader import ReadReport, iter_batches
    from thinkcraft.data.schema import SUMMARY_COLUMNS, TOP_LEVEL, record_to_json_dict
    from thinkcraft.utils.io import atomic_path

    columns = list(TOP_LEVEL) if cfg.include_tokens else list(SUMMARY_COLUMNS)
    report = ReadReport()

    def write(fh) -> int:
        n = 0
        for batch in iter_batches(cfg.dir, batch_size=64, columns=columns, run=cfg.run, report=report):
            for rec in batch:
                if cfg.limit and n >= cfg.limit:
                    return n
                fh.write(json.dumps(record_to_json_dict(rec, include_tokens=cfg.include_tokens), ensure_ascii=False) + "\n")
                n += 1
        return n

    if cfg.out == "-":
        n = write(sys.stdout)
        sys.stdout.flush()
    else:
        with atomic_path(cfg.out) as tmp:
            with open(tmp, "w", encoding="utf-8") as fh:
                n = write(fh)
    msg = f"exported {n:,} trajectories" + ("" if cfg.out == "-" else f" to {cfg.out}")
    if report.corrupt:
        msg += f"; skipped {len(report.corrupt)} corrupt file(s): " + ", ".join(str(p) for p, _ in report.corrupt)
    print(msg, file=sys.stderr)
    return 0
