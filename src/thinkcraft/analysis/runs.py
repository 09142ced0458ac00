"""Run directories -> seeds -> groups: what `thinkcraft compare` reads and how it pools runs.

A run directory holds `config.json` (the command's config) and `metrics.jsonl` (utils.metrics: one flat
record per logged chunk, `step` = env steps; llm-policy keys by learner step).

Multi-seed run directories (`train ppo --num-seeds K`, and bench/baselines_adapter.py) follow one layout:
each metrics record MAY carry an integer `seed_index` (0..K-1) and the config MAY carry `num_seeds`; the
records of one directory with different `seed_index` are different seeds, seed = config `seed` +
seed_index. A directory whose records have no `seed_index` is one seed.

Groups: by default the runs whose configs agree on every field except those in `IGNORED_FIELDS` (names,
paths, seeds, logging, checkpointing, and switches that change speed but not learning) pool into one
group, labelled by the fields that differ between groups. A config without `system` was written by
thinkcraft (`system: thinkcraft`); bench/baselines_adapter.py writes `system: baselines`.
"""

from __future__ import annotations

import functools
import glob
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from thinkcraft.utils.errors import UserError
from thinkcraft.utils.metrics import read_metrics, run_metrics_path

IGNORED_FIELDS = frozenset({
    "_derived", "run_name", "run_dir", "runs_dir", "seed", "num_seeds", "resume", "overwrite",
    "checkpoint_every_updates", "checkpoint_every_minutes", "checkpoint_every", "tensorboard", "wandb_project",
    "plot", "stop_after_updates", "updates_per_chunk", "unroll_env_scans", "log_every", "source",
    "their_argv", "baselines_dir", "baselines_commit",  # bench/baselines_adapter.py's provenance
    "minibatch_size", "num_updates",  # derived (Baselines' make_train writes them into its config)
    # placement (README "Scale-out"): the same global batch and update on any number of devices or hosts
    "devices", "coordinator_address", "num_processes", "process_id", "feature_devices", "feature_timeout_s",
    "feature_retries", "ray_feature_engines", "ray_address",
})
"""Config fields that never define a group (they name, place, seed, log or speed up a run)."""

CONFIG_DEFAULTS = {"system": "thinkcraft"}
"""Values of fields a config may lack (our own configs do not say `system`)."""

PREFERRED_LABEL_FIELDS = ("system", "policy", "env_name", "env", "model")
"""Fields a short group label names first when several would separate the groups."""

RECORD_KEYS = frozenset({"step", "time_s", "seed_index", "update"})
"""Record fields that are bookkeeping, not metrics."""


@dataclass
class SeedRun:
    """One seed's metric series: a run directory, or one `seed_index` of a multi-seed one."""

    run_dir: str
    seed_index: int | None
    seed: int | None
    config: dict[str, Any]
    records: list[dict[str, Any]] = field(repr=False)

    @property
    def name(self) -> str:
        return self.run_dir if self.seed_index is None else f"{self.run_dir}[{self.seed_index}]"

    def series(self, metric: str, x_key: str = "step") -> tuple[np.ndarray, np.ndarray]:
        """(x, value) of the records that carry a finite `metric` (and `x_key`), sorted by x."""
        pts = [(r[x_key], r[metric]) for r in self.records
               if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])
               and isinstance(r.get(x_key), (int, float))]
        xs, ys = zip(*pts) if pts else ((), ())
        x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
        order = np.argsort(x, kind="stable")
        return x[order], y[order]

    @functools.cached_property
    def metric_names(self) -> frozenset[str]:
        return frozenset(k for r in self.records for k, v in r.items()
                         if k not in RECORD_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool))


def expand_run_dirs(patterns: Sequence[str]) -> tuple[list[Path], list[str]]:
    """Run directories named or matched by glob patterns (`runs/ppo-*`), in order, without duplicates, and
    warnings. A directory a glob matched that has no metrics.jsonl (a compare output, a run that died before
    its first log) is skipped with a warning; one named explicitly is kept (loading it is the error)."""
    out: list[Path] = []
    skipped: list[str] = []
    for p in patterns:
        if not glob.has_magic(p):
            if not Path(p).is_dir():
                raise UserError(f"{p}: no such run directory")
            out += [Path(p)] if Path(p) not in out else []
            continue
        for m in sorted(glob.glob(p)):
            path = Path(m)
            if not path.is_dir() or path in out:
                continue
            if run_metrics_path(path) is not None:
                out.append(path)
            else:
                skipped.append(m)
    if not out:
        raise UserError(f"no run directories (with a metrics.jsonl) matched {' '.join(patterns)}")
    warnings = [f"skipped {len(skipped)} matched director{'y' if len(skipped) == 1 else 'ies'} without "
                f"metrics.jsonl: {', '.join(skipped)}"] if skipped else []
    return out, warnings


def load_seed_runs(run_dir: Path) -> tuple[list[SeedRun], list[str]]:
    """The seeds of one run directory (split by `seed_index`), and warnings."""
    metrics_path = run_metrics_path(run_dir)
    if metrics_path is None:
        raise UserError(f"{run_dir} has no metrics.jsonl (is it a run directory?)")
    warnings = []
    cfg_path = run_dir / "config.json"
    if cfg_path.exists():
        config = json.loads(cfg_path.read_text())
    else:
        config = {}
        warnings.append(f"{run_dir} has no config.json: it forms a group only by --label or its name")
    records = read_metrics(metrics_path)
    if not records:
        raise UserError(f"{metrics_path} holds no records yet")
    base_seed = config.get("seed")
    by_index: dict[int | None, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_index[r.get("seed_index")].append(r)
    if None in by_index and len(by_index) > 1:
        raise UserError(f"{metrics_path}: some records carry seed_index and some do not; cannot tell the seeds apart")
    runs = []
    for idx in sorted(by_index, key=lambda i: -1 if i is None else int(i)):
        seed = None if base_seed is None else int(base_seed) + (0 if idx is None else int(idx))
        runs.append(SeedRun(str(run_dir), None if idx is None else int(idx), seed, config, by_index[idx]))
    if config.get("num_seeds") and int(config["num_seeds"]) != len(runs):
        warnings.append(f"{run_dir}: config says num_seeds={config['num_seeds']} but metrics hold {len(runs)} seed(s)")
    return runs, warnings


def _field_value(config: dict[str, Any], key: str) -> Any:
    return config.get(key, CONFIG_DEFAULTS.get(key))


def _fmt_value(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def differing_fields(configs: Sequence[dict[str, Any]]) -> list[str]:
    """Config fields (outside IGNORED_FIELDS) whose values are not the same in every config, sorted."""
    keys = sorted({k for c in configs for k in c} | set(CONFIG_DEFAULTS))
    return [k for k in keys if k not in IGNORED_FIELDS
            and len({_fmt_value(_field_value(c, k)) for c in configs}) > 1]


def label_fields(configs: Sequence[dict[str, Any]], fields: Sequence[str]) -> list[str]:
    """The fewest of `fields` whose values still separate the configs exactly as all `fields` do: short group
    labels (`policy=rnn`, not the dozen fields only one script's config has), the same groups. Greedy, trying
    PREFERRED_LABEL_FIELDS first, then fields every config has, then by name."""

    def key(c: dict[str, Any], ks: Sequence[str]) -> tuple[str, ...]:
        return tuple(_fmt_value(_field_value(c, k)) for k in ks)

    def partition(ks: Sequence[str]) -> set[frozenset[int]]:
        blocks: dict[tuple[str, ...], set[int]] = defaultdict(set)
        for i, c in enumerate(configs):
            blocks[key(c, ks)].add(i)
        return {frozenset(b) for b in blocks.values()}

    target = partition(fields)

    def rank(k: str) -> tuple[int, bool, str]:
        pref = PREFERRED_LABEL_FIELDS.index(k) if k in PREFERRED_LABEL_FIELDS else len(PREFERRED_LABEL_FIELDS)
        return pref, not all(k in c or k in CONFIG_DEFAULTS for c in configs), k

    ordered = sorted(fields, key=rank)
    chosen: list[str] = []
    for k in ordered:
        if partition(chosen) == target:
            break
        if len(partition([*chosen, k])) > len(partition(chosen)):
            chosen.append(k)
    return [k for k in fields if k in chosen]


def parse_labels(labels: Sequence[str]) -> dict[str, str]:
    """`DIR=name` pairs -> {resolved dir: name}."""
    out = {}
    for item in labels:
        d, sep, name = item.rpartition("=")
        if not sep or not d or not name:
            raise UserError(f"--label {item!r}: expected DIR=name")
        out[str(Path(d).resolve())] = name
    return out


def assign_groups(runs: Sequence[SeedRun], group_by: Sequence[str] = (), labels: dict[str, str] | None = None,
                  ) -> tuple[dict[str, list[SeedRun]], list[str]]:
    """{group label: seeds} in first-seen order, and the config fields that define the groups.

    `labels` (resolved dir -> name) wins for the dirs it names; the rest group by `group_by` fields if given,
    else by every differing field; with no differing field all runs are one group."""
    labels = labels or {}
    unlabelled = [r for r in runs if str(Path(r.run_dir).resolve()) not in labels]
    if group_by:
        for k in group_by:
            if not any(k in r.config or k in CONFIG_DEFAULTS for r in runs):
                known = sorted({k2 for r in runs for k2 in r.config} - IGNORED_FIELDS)
                raise UserError(f"--group-by {k}: no run's config has that field; fields: {', '.join(known)}")
        fields_ = list(group_by)
    else:
        fields_ = label_fields([r.config for r in unlabelled], differing_fields([r.config for r in unlabelled]))
    groups: dict[str, list[SeedRun]] = {}
    for r in runs:
        name = labels.get(str(Path(r.run_dir).resolve()))
        if name is None:
            if fields_:
                name = ", ".join(f"{k}={_fmt_value(_field_value(r.config, k))}" for k in fields_)
            else:
                name = str(r.config.get("env_name") or r.config.get("env") or "all runs")
        groups.setdefault(name, []).append(r)
    return groups, fields_


def group_warnings(groups: dict[str, list[SeedRun]]) -> list[str]:
    out = []
    for name, seeds in groups.items():
        if len(seeds) == 1:
            out.append(f"group '{name}' has a single seed: its confidence intervals need several seeds "
                       f"(shown as the point itself)")
        seen = [s.seed for s in seeds if s.seed is not None]
        dup = sorted({s for s in seen if seen.count(s) > 1})
        if dup:
            out.append(f"group '{name}' holds seed(s) {dup} more than once (counted as separate runs)")
    return out


def available_metrics(runs: Sequence[SeedRun]) -> list[str]:
    return sorted(set().union(*(r.metric_names for r in runs)))


def describe_metrics(names: Sequence[str], max_shown: int = 40) -> str:
    """Metric names for an error message; `achievements/*` collapsed to a count."""
    ach = [n for n in names if n.startswith("achievements/") and n != "achievements/mean_rate"]
    rest = [n for n in names if n not in ach]
    shown = rest[:max_shown] + ([f"... ({len(rest) - max_shown} more)"] if len(rest) > max_shown else [])
    if ach:
        shown.append(f"achievements/<name> ({len(ach)} names, e.g. {ach[0]})")
    return ", ".join(shown) if shown else "(none)"
