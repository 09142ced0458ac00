"""Trajectory filters (seed 003 §6): which episodes enter a training batch.

Each filter is a small callable object: `filter(table) -> FilterDecision(keep mask, reasons)`, with
`columns` naming the (pruned) columns it needs, so `read_trajectories(..., filters=[...])` reads
rewards and metadata without the token columns. `apply_filters` chains them in order (each sees what
the previous kept) and counts every drop by filter and reason, so dropped episodes stay countable.

- completeness: drop truncated / env-errored episodes.
- reward: drop GRPO groups whose rewards are all zero (no advantage signal; keep a few as negatives),
  drop reward outliers (robust z-score).
- duplicates: drop episodes whose action n-grams overlap too much with an already-kept one
  (the "Echo Trap": a policy collapsing onto one repeated behaviour).
- balance: cap the positive:negative ratio per batch.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Protocol, Sequence, TypeVar

import numpy as np
import pyarrow as pa


@dataclass
class FilterDecision:
    keep: np.ndarray
    """bool[num_rows]: True = keep."""
    reasons: dict[str, int] = field(default_factory=dict)
    """Dropped rows counted by reason (a row dropped for two reasons counts in both)."""


class Filter(Protocol):
    name: str
    columns: tuple[str, ...]

    def __call__(self, table: pa.Table) -> FilterDecision: ...


@dataclass
class FilterStats:
    rows_in: int = 0
    rows_kept: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    @property
    def rows_dropped(self) -> int:
        return self.rows_in - self.rows_kept


@dataclass
class FilterReport:
    """Per-filter counts, accumulated over calls (e.g. every batch of `iter_batches`)."""

    stats: dict[str, FilterStats] = field(default_factory=dict)
    dropped: dict[str, list[pa.Table]] = field(default_factory=dict)
    """Dropped rows per filter, kept only when `keep_dropped` is set (diagnostics)."""
    keep_dropped: bool = False

    def add(self, name: str, table: pa.Table, decision: FilterDecision) -> None:
        s = self.stats.setdefault(name, FilterStats())
        s.rows_in += table.num_rows
        s.rows_kept += int(decision.keep.sum())
        for k, v in decision.reasons.items():
            s.reasons[k] = s.reasons.get(k, 0) + int(v)
        if self.keep_dropped and not decision.keep.all():
            self.dropped.setdefault(name, []).append(table.filter(pa.array(~decision.keep)))

    def summary(self) -> dict[str, dict]:
        return {n: {"in": s.rows_in, "kept": s.rows_kept, "dropped": s.rows_dropped, **s.reasons} for n, s in self.stats.items()}


T = TypeVar("T")


def apply_filters(data: T, filters: Sequence[Filter], report: FilterReport | None = None) -> T:
    """Run `filters` in order over a pyarrow Table or a list of `TrajectoryRecord`s; same kind out."""
    if isinstance(data, pa.Table):
        table = data
        for f in filters:
            d = f(table)
            if report is not None:
                report.add(f.name, table, d)
            table = table.filter(pa.array(d.keep)) if not d.keep.all() else table
        return table  # type: ignore[return-value]
    from thinkcraft.data.schema import TrajectoryRecord, Turn, records_to_table

    records = list(data)  # type: ignore[call-overload]
    # filters read no token columns: convert light copies (text, rewards, metadata) only
    light = [
        TrajectoryRecord(r.task_id, r.trajectory_id, [Turn(t.think, t.act, t.obs, t.reward, t.done) for t in r.turns],
                         r.total_reward, r.metadata)
        for r in records
    ]
    table = records_to_table(light).select(["task_id", "trajectory_id", "total_reward", "turns", "metadata"])
    idx = np.arange(len(records))
    for f in filters:
        d = f(table)
        if report is not None:
            report.add(f.name, table, d)
        if not d.keep.all():
            table = table.filter(pa.array(d.keep))
            idx = idx[d.keep]
    return [records[i] for i in idx]  # type: ignore[return-value]


# ---------------------------------------------------------------- column access


def column_numpy(table: pa.Table, name: str) -> np.ndarray:
    """A flat column ('total_reward', 'metadata.truncated', 'task_id', ...) as numpy."""
    if "." in name:
        top, sub = name.split(".", 1)
        arr = table.column(top).combine_chunks().field(sub)
    else:
        arr = table.column(name).combine_chunks()
    return arr.to_numpy(zero_copy_only=False)


def turn_lists(table: pa.Table, sub: str) -> list[list]:
    """Per-row lists of one turn field, e.g. the action strings of every episode."""
    turns = table.column("turns").combine_chunks()
    values = turns.values.field(sub).to_pylist()
    offsets = turns.offsets.to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(turns))]


# ---------------------------------------------------------------- completeness


@dataclass
class CompletenessFilter:
    drop_truncated: bool = True
    drop_env_errors: bool = True
    name: str = "completeness"

    @property
    def columns(self) -> tuple[str, ...]:
        return ("metadata.truncated", "metadata.env_errors")

    def __call__(self, table: pa.Table) -> FilterDecision:
        n = table.num_rows
        trunc = column_numpy(table, "metadata.truncated").astype(bool) if n else np.zeros(0, bool)
        errs = column_numpy(table, "metadata.env_errors") > 0 if n else np.zeros(0, bool)
        drop = np.zeros(n, bool)
        if self.drop_truncated:
            drop |= trunc
        if self.drop_env_errors:
            drop |= errs
        return FilterDecision(~drop, {"truncated": int(trunc.sum()) if self.drop_truncated else 0,
                                      "env_errors": int(errs.sum()) if self.drop_env_errors else 0})


def completeness_filter(drop_truncated: bool = True, drop_env_errors: bool = True) -> CompletenessFilter:
    """Drop truncated and/or env-errored episodes (counted by reason in the report)."""
    return CompletenessFilter(drop_truncated, drop_env_errors)


# ---------------------------------------------------------------- reward


@dataclass
class ZeroRewardGroupFilter:
    group_by: str = "task_id"
    keep_fraction: float = 0.0
    drop_constant: bool = False
    name: str = "zero_reward_group"

    def __post_init__(self) -> None:
        if not 0.0 <= self.keep_fraction <= 1.0:
            raise ValueError(f"keep_fraction must be in [0, 1], got {self.keep_fraction}")

    @property
    def columns(self) -> tuple[str, ...]:
        return ("total_reward", self.group_by)

    def __call__(self, table: pa.Table) -> FilterDecision:
        n = table.num_rows
        if n == 0:
            return FilterDecision(np.ones(0, bool))
        rewards = column_numpy(table, "total_reward").astype(np.float64)
        keys = column_numpy(table, self.group_by)
        _, inverse = np.unique(keys.astype(str), return_inverse=True)
        num_groups = inverse.max() + 1
        rmin = np.full(num_groups, np.inf)
        rmax = np.full(num_groups, -np.inf)
        np.minimum.at(rmin, inverse, rewards)
        np.maximum.at(rmax, inverse, rewards)
        constant = rmin == rmax
        bad = constant if self.drop_constant else (constant & (rmax == 0.0))
        # keep a stable, seedless sample of bad groups as negatives: a hash of the group key, not RNG
        # state, so the same group is kept on every read.
        if self.keep_fraction > 0:
            first = np.zeros(num_groups, dtype=np.int64)
            first[inverse[::-1]] = np.arange(n)[::-1]
            for g in np.flatnonzero(bad):
                if zlib.crc32(str(keys[first[g]]).encode()) / 2**32 < self.keep_fraction:
                    bad[g] = False
        drop = bad[inverse]
        zero_groups = int((constant & (rmax == 0.0) & bad).sum())
        return FilterDecision(~drop, {"groups_dropped": int(bad.sum()), "all_zero_groups_dropped": zero_groups,
                                      "rows": int(drop.sum())})


def zero_reward_group_filter(group_by: str = "task_id", keep_fraction: float = 0.0, drop_constant: bool = False) -> ZeroRewardGroupFilter:
    """Drop GRPO groups (rows sharing `group_by`) whose rewards are all zero: their advantages are all 0.

    `keep_fraction` keeps that share of such groups as negatives (chosen by a hash of the group key,
    stable across reads); `drop_constant` also drops groups whose rewards are all equal but non-zero.
    """
    return ZeroRewardGroupFilter(group_by, keep_fraction, drop_constant)


@dataclass
class RewardOutlierFilter:
    z_max: float = 4.0
    low: float | None = None
    high: float | None = None
    name: str = "reward_outlier"

    @property
    def columns(self) -> tuple[str, ...]:
        return ("total_reward",)

    def __call__(self, table: pa.Table) -> FilterDecision:
        r = column_numpy(table, "total_reward").astype(np.float64) if table.num_rows else np.zeros(0)
        drop_abs = np.zeros(len(r), bool)
        if self.low is not None:
            drop_abs |= r < self.low
        if self.high is not None:
            drop_abs |= r > self.high
        drop_z = np.zeros(len(r), bool)
        if len(r) >= 3 and np.isfinite(self.z_max):
            z = robust_z(r)
            drop_z = np.abs(z) > self.z_max
        drop_nan = ~np.isfinite(r)
        drop = drop_abs | drop_z | drop_nan
        return FilterDecision(~drop, {"out_of_bounds": int(drop_abs.sum()), "z_outliers": int((drop_z & ~drop_abs).sum()),
                                      "non_finite": int(drop_nan.sum())})


def robust_z(x: np.ndarray) -> np.ndarray:
    """(x - median) / (1.4826 * MAD); falls back to the standard deviation when MAD is 0 (e.g. mostly-zero
    rewards), and to all-zeros when x is constant."""
    finite = x[np.isfinite(x)]
    if finite.size == 0:
        return np.zeros_like(x)
    med = np.median(finite)
    scale = 1.4826 * np.median(np.abs(finite - med))
    if scale == 0:
        scale = finite.std()
        med = finite.mean()
    if scale == 0:
        return np.zeros_like(x)
    return (x - med) / scale


def reward_outlier_filter(z_max: float = 4.0, low: float | None = None, high: float | None = None) -> RewardOutlierFilter:
    """Drop episodes whose total reward is anomalous: |robust z| > z_max, or outside [low, high]."""
    return RewardOutlierFilter(z_max, low, high)


# ---------------------------------------------------------------- duplicates


def action_ngrams(actions: Sequence[str], n: int) -> set[str]:
    """The set of action n-grams of one episode (the whole sequence if it is shorter than n)."""
    if len(actions) < n:
        return {"\x1f".join(actions)} if actions else set()
    return {"\x1f".join(actions[i : i + n]) for i in range(len(actions) - n + 1)}


@dataclass
class DuplicateFilter:
    """Stateful: remembers the n-gram sets it kept, so later batches are compared with earlier ones."""

    n: int = 4
    max_similarity: float = 0.9
    name: str = "duplicate"
    _vocab: dict[str, int] = field(default_factory=dict, repr=False)
    _kept_rows: list[np.ndarray] = field(default_factory=list, repr=False)
    _kept_sizes: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0.0 <= self.max_similarity <= 1.0:
            raise ValueError(f"max_similarity must be in [0, 1], got {self.max_similarity}")

    @property
    def columns(self) -> tuple[str, ...]:
        return ("turns.act",)

    def reset(self) -> None:
        self._vocab.clear()
        self._kept_rows.clear()
        self._kept_sizes.clear()

    @property
    def num_kept(self) -> int:
        return len(self._kept_rows)

    def _ids(self, grams: set[str]) -> np.ndarray:
        v = self._vocab
        return np.array(sorted(v.setdefault(g, len(v)) for g in grams), dtype=np.int64)

    chunk_rows: int = 1024
    """Rows compared at once (memory ~ chunk_rows x (chunk_rows + kept) floats)."""

    def __call__(self, table: pa.Table) -> FilterDecision:
        if table.num_rows > self.chunk_rows:
            parts = [self(table.slice(i, self.chunk_rows)) for i in range(0, table.num_rows, self.chunk_rows)]
            keep = np.concatenate([p.keep for p in parts])
            return FilterDecision(keep, {"near_duplicates": int((~keep).sum())})
        return self._call_chunk(table)

    def _call_chunk(self, table: pa.Table) -> FilterDecision:
        import scipy.sparse as sp

        n_rows = table.num_rows
        if n_rows == 0:
            return FilterDecision(np.ones(0, bool))
        sets = [self._ids(action_ngrams(a, self.n)) for a in turn_lists(table, "act")]
        vocab = max(len(self._vocab), 1)

        def matrix(rows: list[np.ndarray]):
            indptr = np.zeros(len(rows) + 1, np.int64)
            np.cumsum([len(r) for r in rows], out=indptr[1:])
            data = np.ones(int(indptr[-1]), np.float32)
            ind = np.concatenate(rows) if rows else np.zeros(0, np.int64)
            return sp.csr_matrix((data, ind, indptr), shape=(len(rows), vocab))

        sizes = np.array([len(s) for s in sets], np.float64)
        cand = matrix(sets)
        # Jaccard vs everything kept before this call (one sparse product), then greedily within
        # the call, in row order: row i is compared with the rows of this call kept before it.
        best_prev = np.zeros(n_rows)
        if self._kept_rows:
            shared = (cand @ matrix(self._kept_rows).T).toarray()
            union = sizes[:, None] + np.array(self._kept_sizes, np.float64)[None, :] - shared
            best_prev = np.max(np.where(union > 0, shared / np.maximum(union, 1), 0.0), axis=1)
        shared_in = (cand @ cand.T).toarray()
        union_in = sizes[:, None] + sizes[None, :] - shared_in
        jac_in = np.where(union_in > 0, shared_in / np.maximum(union_in, 1), 0.0)
        keep = np.zeros(n_rows, bool)
        for i in range(n_rows):
            if sizes[i] == 0:  # no actions: nothing to compare
                keep[i] = True
                continue
            sim = best_prev[i]
            kept_before = np.flatnonzero(keep[:i])
            if kept_before.size:
                sim = max(sim, jac_in[i, kept_before].max())
            keep[i] = sim <= self.max_similarity
        for i in np.flatnonzero(keep):
            self._kept_rows.append(sets[i])
            self._kept_sizes.append(len(sets[i]))
        return FilterDecision(keep, {"near_duplicates": int((~keep).sum())})


def duplicate_filter(n: int = 4, max_similarity: float = 0.9) -> DuplicateFilter:
    """Drop episodes whose action n-gram set has Jaccard similarity > `max_similarity` with any episode
    this filter kept before (in this call or an earlier one; `reset()` forgets)."""
    return DuplicateFilter(n, max_similarity)


# ---------------------------------------------------------------- balance


@dataclass
class BalanceFilter:
    max_ratio: float = 3.0
    threshold: float = 0.0
    seed: int = 0
    name: str = "balance"
    _calls: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.max_ratio < 1.0:
            raise ValueError(f"max_ratio must be >= 1, got {self.max_ratio}")

    @property
    def columns(self) -> tuple[str, ...]:
        return ("total_reward",)

    def __call__(self, table: pa.Table) -> FilterDecision:
        n = table.num_rows
        keep = np.ones(n, bool)
        if n == 0:
            return FilterDecision(keep)
        pos = column_numpy(table, "total_reward").astype(np.float64) > self.threshold
        num_pos, num_neg = int(pos.sum()), int(n - pos.sum())
        minority = min(num_pos, num_neg)
        if minority == 0:  # one-sided batch: nothing to balance against; keep it, count it
            return FilterDecision(keep, {"one_sided_batches": 1})
        cap = int(np.floor(self.max_ratio * minority))
        majority_mask = pos if num_pos > num_neg else ~pos
        excess = int(majority_mask.sum()) - cap
        if excess > 0:
            # drop a seeded random subset of the majority side (not the last rows: order may carry bias)
            rng = np.random.default_rng([self.seed, self._calls])
            drop = rng.choice(np.flatnonzero(majority_mask), size=excess, replace=False)
            keep[drop] = False
        self._calls += 1
        side = "positives" if num_pos > num_neg else "negatives"
        return FilterDecision(keep, {f"{side}_dropped": max(excess, 0)})


def balance_filter(max_ratio: float = 3.0, threshold: float = 0.0, seed: int = 0) -> BalanceFilter:
    """Per batch, keep at most `max_ratio` x as many episodes of the majority side as of the minority,
    where positive means total_reward > `threshold`. A batch with only one side is kept (and counted)."""
    return BalanceFilter(max_ratio, threshold, seed)


__all__ = [
    "Filter",
    "FilterDecision",
    "FilterReport",
    "FilterStats",
    "apply_filters",
    "completeness_filter",
    "zero_reward_group_filter",
    "reward_outlier_filter",
    "duplicate_filter",
    "balance_filter",
    "action_ngrams",
    "robust_z",
]
