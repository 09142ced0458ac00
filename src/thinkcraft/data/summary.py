"""`thinkcraft data inspect`: a summary of a store, computed from the small columns only.

Reads rewards, per-turn rewards (for lengths) and metadata; token totals come from the writers'
`metadata.total_tokens` and from the Parquet footers (values stored per token column), so no token
data page is read.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from thinkcraft.data.reader import ReadReport, read_files, scan_store
from thinkcraft.data.schema import TOKEN_FIELDS, parquet_paths

INSPECT_COLUMNS = ("total_reward", "turns.reward", "metadata", "run", "learner_step")


@dataclass
class Distribution:
    count: int = 0
    mean: float = float("nan")
    std: float = float("nan")
    min: float = float("nan")
    p10: float = float("nan")
    p50: float = float("nan")
    p90: float = float("nan")
    max: float = float("nan")
    total: float = 0.0

    @classmethod
    def of(cls, x: np.ndarray) -> "Distribution":
        x = np.asarray(x, dtype=np.float64)
        x = x[np.isfinite(x)]
        if x.size == 0:
            return cls()
        p10, p50, p90 = np.percentile(x, [10, 50, 90])
        return cls(int(x.size), float(x.mean()), float(x.std()), float(x.min()), float(p10), float(p50), float(p90),
                   float(x.max()), float(x.sum()))


@dataclass
class FileInfo:
    path: str
    rows: int
    size_bytes: int


@dataclass
class StoreSummary:
    root: str
    num_trajectories: int = 0
    num_files: int = 0
    total_bytes: int = 0
    corrupt: list[tuple[str, str]] = field(default_factory=list)
    other_version: list[tuple[str, str]] = field(default_factory=list)
    num_foreign: int = 0
    num_stale_tmp: int = 0
    runs: dict[str, int] = field(default_factory=dict)
    learner_steps: Distribution = field(default_factory=Distribution)
    """The update that trains on each trajectory: the `step` of its line in the run's metrics.jsonl."""
    reward: Distribution = field(default_factory=Distribution)
    frac_positive: float = float("nan")
    frac_zero: float = float("nan")
    turns: Distribution = field(default_factory=Distribution)
    tokens: Distribution = field(default_factory=Distribution)
    """Per trajectory, as declared in metadata.total_tokens."""
    token_values_stored: dict[str, int] = field(default_factory=dict)
    """Values stored per token column (from the Parquet footers)."""
    wall_time_s: Distribution = field(default_factory=Distribution)
    truncation_rate: float = float("nan")
    env_error_rate: float = float("nan")
    """Share of trajectories with at least one environment error."""
    env_errors_total: int = 0
    policy_versions: Distribution = field(default_factory=Distribution)
    num_policy_versions: int = 0
    policy_lag: Distribution = field(default_factory=Distribution)
    """learner_step - policy_version per trajectory (1 = on-policy: sampled by the policy the update starts from)."""
    file_sizes: Distribution = field(default_factory=Distribution)
    files: list[FileInfo] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_store(root: str | os.PathLike) -> tuple[StoreSummary, dict[str, np.ndarray]]:
    """(summary, raw per-trajectory arrays for plotting). Raises StoreError if `root` is not a store."""
    root = Path(root)
    scan = scan_store(root)
    report = ReadReport()
    table = read_files(scan.files, parquet_paths(INSPECT_COLUMNS), report)
    s = StoreSummary(root=str(root))
    s.num_files = len(scan.files)
    base = root if root.is_dir() else root.parent
    s.files = [FileInfo(str(f.path.relative_to(base)), f.num_rows, f.size_bytes) for f in scan.files]
    s.total_bytes = sum(f.size_bytes for f in scan.files)
    s.file_sizes = Distribution.of(np.array([f.size_bytes for f in scan.files]))
    bad = {str(p) for p, _ in report.corrupt}
    s.corrupt = [(str(p), r) for p, r in scan.corrupt] + [(str(p), r) for p, r in report.corrupt]
    if bad:  # files whose footer read fine but whose data did not
        s.files = [fi for fi in s.files if str(base / fi.path) not in bad]
    s.other_version = [(str(p), v) for p, v in scan.other_version]
    s.num_foreign = len(scan.foreign)
    s.num_stale_tmp = len(scan.stale_tmp)
    for f in scan.files:
        if str(f.path) in bad:
            continue
        md = f.metadata
        for rg in range(md.num_row_groups):
            g = md.row_group(rg)
            for i in range(g.num_columns):
                c = g.column(i)
                for name in TOKEN_FIELDS:
                    if c.path_in_schema == f"turns.list.element.{name}.list.element":
                        # empty lists store one null placeholder each: values = entries - nulls
                        nulls = c.statistics.null_count if c.statistics is not None and c.statistics.has_null_count else 0
                        s.token_values_stored[name] = s.token_values_stored.get(name, 0) + c.num_values - nulls
    n = table.num_rows
    s.num_trajectories = n
    arrays: dict[str, np.ndarray] = {}
    if n == 0:
        return s, arrays
    reward = table.column("total_reward").to_numpy()
    turns = table.column("turns").combine_chunks()
    num_turns = np.diff(turns.offsets.to_numpy(zero_copy_only=False))
    md = table.column("metadata").combine_chunks()

    def mdf(name: str) -> np.ndarray:
        return md.field(name).to_numpy(zero_copy_only=False)

    runs, counts = np.unique(np.asarray(table.column("run").to_pylist(), dtype=str), return_counts=True)
    s.runs = {str(r): int(c) for r, c in zip(runs, counts)}
    steps = table.column("learner_step").to_numpy()
    s.learner_steps = Distribution.of(steps)
    s.reward = Distribution.of(reward)
    s.frac_positive = float((reward > 0).mean())
    s.frac_zero = float((reward == 0).mean())
    s.turns = Distribution.of(num_turns)
    tokens = mdf("total_tokens")
    s.tokens = Distribution.of(tokens)
    s.wall_time_s = Distribution.of(mdf("wall_time"))
    s.truncation_rate = float(mdf("truncated").astype(bool).mean())
    errs = mdf("env_errors")
    s.env_error_rate = float((errs > 0).mean())
    s.env_errors_total = int(errs.sum())
    pv = mdf("policy_version")
    s.policy_versions = Distribution.of(pv)
    s.num_policy_versions = int(np.unique(pv).size)
    s.policy_lag = Distribution.of(steps - pv)
    arrays = {"total_reward": reward, "turns": num_turns, "total_tokens": tokens}
    return s, arrays


def plot_summary(arrays: dict[str, np.ndarray], out_png: str | os.PathLike, title: str = "") -> Path | None:
    """Histograms of total reward, turns and tokens per trajectory (headless)."""
    if not arrays:
        return None
    from thinkcraft.utils.plot import pyplot, save_figure

    plt = pyplot()
    labels = {"total_reward": "total reward", "turns": "turns per trajectory", "total_tokens": "tokens per trajectory"}
    fig, axes = plt.subplots(1, len(arrays), figsize=(4.2 * len(arrays), 3.2), squeeze=False)
    for ax, (k, v) in zip(axes[0], arrays.items()):
        v = np.asarray(v, dtype=np.float64)
        ax.hist(v[np.isfinite(v)], bins=min(50, max(5, int(np.sqrt(v.size)))), color="#4477aa")
        ax.set_xlabel(labels.get(k, k))
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("trajectories")
    if title:
        fig.suptitle(title)
    return save_figure(fig, out_png)
