"""`thinkcraft plan RUN_DIR --target-samples-per-s X [--nodes N --gpus-per-node G]`: capacity planning from
a short measured run (DESIGN "Scale-out"; seed 003's capacity planning).

    measured = measure(config, records)        # per pool: device-seconds one sample costs (pure)
    p = plan(measured, target=4000, nodes=2, gpus_per_node=8)   # GPUs per pool, bottleneck, placement (pure)

The model. A run's work splits into pools, each on its own devices in a scaled-out run:

| job | pools (metrics read) |
|---|---|
| llm-policy | rollout: `timing/generate`; reward: `timing/reward` (else `timing/env`: the sync loop grades inside its env phase) on a GPU with `--reward judge`, on the CPU with rule rewards; learner: `timing/train` |
| ppo-hidden | features (the LLM): `timing/llm`; env (env+policy steps and the PPO update, JAX): `timing/env_policy + timing/update + timing/norm`; render (host CPU): `timing/render` |
| ppo | env: the whole update (1 / sps per device) |

Samples per record: llm-policy `perf/samples_per_s × timing/step` (episodes); ppo-hidden / ppo env steps,
`sps × timing/update_wall` (ppo: `sps` alone). The cost of a sample in pool p is
`c_p = timing/<p> × devices_p / samples` device-seconds (`devices_p` the pool's devices in the measured run:
timing of a phase spread over k devices is wall time; async runs log `timing/generate` as the engines'
summed busy seconds, so there devices_p = 1). A record's first is the warm-up (compiles): the median over the
others is used. The measured run's bottleneck is the pool with the largest load `rate × c_p / devices_p`
(its busy share; in a synchronous run, the largest phase). For a target rate X, pool p needs
`ceil(X × c_p / utilization)` devices (a pool kept below `utilization` busy: queues stay short). With a
cluster (`--nodes`, `--gpus-per-node`) the best split of its devices is the max-min one (each next device to
the pool that limits the rate), within what thinkcraft can run: one llm-policy learner device (no
data-parallel learner yet), ppo-hidden on one node.

Assumes linear scaling per pool (engines and data-parallel envs are independent; tests/test_sharding.py and
bench/scale.py measure how close). CPU pools (rule rewards, rendering) get no GPUs: the plan says when one
process's CPU cannot keep up.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import tyro

from thinkcraft.utils.errors import UserError, check

LLM_POLICY_KEYS = ("perf/samples_per_s", "timing/step", "timing/generate", "timing/train")
PPO_HIDDEN_KEYS = ("sps", "timing/update_wall", "timing/llm", "timing/env_policy", "timing/update")


class PoolCost(NamedTuple):
    """One pool's measured cost."""

    name: str
    device_s_per_sample: float
    """Device-seconds one sample costs this pool (CPU-seconds for a CPU pool)."""
    measured_devices: int
    on_gpu: bool
    max_devices: int | None = None
    """The most devices thinkcraft can give this pool (None: no limit)."""


class Measured(NamedTuple):
    job: str  # "llm-policy" | "ppo-hidden" | "ppo"
    unit: str  # "samples/s" | "env steps/s"
    rate: float  # measured rate (median over the records used)
    pools: tuple[PoolCost, ...]
    records_used: int
    serial: bool = False
    """The pools ran one after another on shared devices (a synchronous llm-policy run)."""

    def load(self, pool: PoolCost) -> float:
        """The pool's busy share in the measured run."""
        return self.rate * pool.device_s_per_sample / max(pool.measured_devices, 1)

    @property
    def bottleneck(self) -> str:
        return max(self.pools, key=self.load).name


class Plan(NamedTuple):
    measured: Measured
    target: float
    gpus: dict[str, int]
    """GPUs per GPU pool for the target."""
    cpu_cores: dict[str, float]
    """CPU cores per CPU pool for the target."""
    capacity: int | None  # nodes × gpus_per_node
    fits: bool | None
    best_split: dict[str, int] | None
    """The capacity's best split over the GPU pools (None without a cluster)."""
    best_rate: float | None
    placement: list[list[str]] | None
    """Per node: the pool of each of its GPUs (learner first, then reward, then rollout / env, features)."""
    notes: list[str]


def _median(records: list[dict[str, Any]], f: Any) -> float:
    return float(np.median([f(r) for r in records]))


def _need(records: list[dict[str, Any]], keys: tuple[str, ...], job: str) -> None:
    missing = sorted({k for k in keys for r in records if r.get(k) is None})
    if missing:
        raise UserError(f"the {job} metrics lack {', '.join(missing)} (a run of an older version, or one "
                        f"stopped before its first logged update): measure again with a short run")


def _devices(spec: Any) -> int:
    """Devices named by a config's comma-separated string or list (0 when empty)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec or [])
    return len([s for s in items if str(s).strip()])


def measure(config: dict[str, Any], records: list[dict[str, Any]]) -> Measured:
    """Per-pool costs of a run from its config.json dict and metrics.jsonl records (module doc)."""
    if not records:
        raise UserError("no metrics records: let the run log a few updates (or steps) before planning")
    used = records[1:] if len(records) > 1 else records  # the first record includes compiles / warm-up
    if "perf/samples_per_s" in records[0]:
        return _measure_llm_policy(config, used)
    if "timing/llm" in records[0] or "llm/share" in records[0]:
        return _measure_ppo_hidden(config, used)
    if "sps" in records[0]:
        return _measure_ppo(config, used)
    raise UserError("these metrics are not from train llm-policy, ppo-hidden or ppo (no perf/samples_per_s, "
                    "timing/llm or sps): thinkcraft plan reads those runs' metrics.jsonl")


def _measure_llm_policy(config: dict[str, Any], recs: list[dict[str, Any]]) -> Measured:
    _need(recs, LLM_POLICY_KEYS, "llm-policy")
    is_async = config.get("mode") == "async"
    rollout_devices = (_devices(config.get("rollout_devices")) + _devices(config.get("rollout_servers"))) or 1

    def per_sample(phase: str, devices: int = 1):
        return _median(recs, lambda r: r.get(phase, 0.0) * devices / (r["perf/samples_per_s"] * r["timing/step"]))

    judge = config.get("reward") == "judge"
    reward_phase = "timing/reward" if "timing/reward" in recs[0] else "timing/env"
    pools = (
        # async: timing/generate is the engines' summed busy time (already device-seconds)
        PoolCost("rollout", per_sample("timing/generate", 1 if is_async else rollout_devices), rollout_devices, True),
        PoolCost("reward" if judge else "env+reward (CPU)", per_sample(reward_phase), 1, judge),
        PoolCost("learner", per_sample("timing/train"), 1, True, max_devices=1),
    )
    return Measured("llm-policy", "samples/s", _median(recs, lambda r: r["perf/samples_per_s"]), pools, len(recs),
                    serial=not is_async)


def _measure_ppo_hidden(config: dict[str, Any], recs: list[dict[str, Any]]) -> Measured:
    _need(recs, PPO_HIDDEN_KEYS, "ppo-hidden")
    D = int((config.get("_derived") or {}).get("env_shards", 1))
    K = _devices(config.get("feature_devices")) or int(config.get("ray_feature_engines") or 0) or 1

    def per_step(f: Any, devices: int):
        return _median(recs, lambda r: f(r) * devices / (r["sps"] * r["timing/update_wall"]))

    env = per_step(lambda r: r["timing/env_policy"] + r["timing/update"] + r.get("timing/norm", 0.0), D)
    pools = (
        PoolCost("env", env, D, True),
        PoolCost("features", per_step(lambda r: r["timing/llm"], K), K, True),
        PoolCost("render (CPU)", per_step(lambda r: r.get("timing/render", 0.0), 1), 1, False),
    )
    return Measured("ppo-hidden", "env steps/s", _median(recs, lambda r: r["sps"]), pools, len(recs))


def _measure_ppo(config: dict[str, Any], recs: list[dict[str, Any]]) -> Measured:
    D = int((config.get("_derived") or {}).get("env_shards", 1))
    sps = _median(recs, lambda r: r["sps"])
    return Measured("ppo", "env steps/s", sps, (PoolCost("env", D / sps, D, True),), len(recs))


def plan(m: Measured, target: float, nodes: int | None = None, gpus_per_node: int | None = None,
         utilization: float = 0.9) -> Plan:
    """GPUs per pool for `target` (in m.unit), and with a cluster the best split of its GPUs (module doc)."""
    gpu_pools = [p for p in m.pools if p.on_gpu]
    gpus = {p.name: max(1, math.ceil(target * p.device_s_per_sample / utilization - 1e-9)) for p in gpu_pools}
    cores = {p.name: target * p.device_s_per_sample for p in m.pools if not p.on_gpu}
    notes = []
    for p in gpu_pools:
        if p.max_devices is not None and gpus[p.name] > p.max_devices:
            notes.append(f"{p.name} needs {gpus[p.name]} GPUs but runs on {p.max_devices} today (no data-parallel "
                         f"{p.name}): the target is out of reach until it has one")
    for name, c in cores.items():
        if c > utilization:
            notes.append(f"{name} needs {c:.1f} CPU cores at the target: one process's Python thread does it, "
                         f"so it caps the rate near {utilization * target / c:,.0f} {m.unit}")
    if m.serial:
        notes.append("measured synchronously (generation, reward and training in turn on one device): the pools "
                     "on their own GPUs are train llm-policy --mode async (--rollout-devices / --rollout-servers)")
    if m.job == "llm-policy" and (nodes or 1) > 1:
        notes.append("llm-policy over several nodes runs its pools as Ray actors (the pools' Ray backend)")
    if m.job == "ppo-hidden":
        notes.append("ppo-hidden runs on one node: --devices for the env, --feature-devices for the LLM")
    capacity = None if nodes is None else nodes * (gpus_per_node or 0)
    split = rate = placement = fits = None
    if capacity is not None:
        usable = gpus_per_node if m.job == "ppo-hidden" else capacity
        fits = sum(gpus.values()) <= usable and all(p.max_devices is None or gpus[p.name] <= p.max_devices
                                                    for p in gpu_pools)
        split, rate = best_split(gpu_pools, usable, utilization)
        placement = place(split, nodes or 1, gpus_per_node or 0)
    return Plan(m, target, gpus, cores, capacity, fits, split, rate, placement, notes)


def best_split(pools: list[PoolCost], total: int, utilization: float) -> tuple[dict[str, int], float]:
    """The max-min split of `total` GPUs over `pools` (one each first; then each next GPU to the pool that
    limits the rate, within its max_devices) and the rate it reaches, trimmed to the GPUs that rate needs (a
    pool capped by max_devices leaves the rest idle). Fewer GPUs than pools: they share."""
    if total < len(pools):
        return {p.name: 0 for p in pools}, total * utilization / sum(p.device_s_per_sample for p in pools)
    n = {p.name: 1 for p in pools}

    def rate_of(p: PoolCost) -> float:
        return n[p.name] * utilization / p.device_s_per_sample if p.device_s_per_sample > 0 else math.inf

    for _ in range(total - len(pools)):
        open_ = [p for p in pools if p.max_devices is None or n[p.name] < p.max_devices]
        if not open_:
            break
        n[min(open_, key=rate_of).name] += 1
    rate = min(rate_of(p) for p in pools)
    if math.isfinite(rate):
        n = {p.name: max(1, min(n[p.name], math.ceil(rate * p.device_s_per_sample / utilization - 1e-9)))
             for p in pools}
    return n, rate


def place(split: dict[str, int], nodes: int, gpus_per_node: int) -> list[list[str]]:
    """Per node, its GPUs' pools: learner and reward first (node 0: the learner's weight broadcast stays
    inside a node for the first engines), then the others, filling nodes in order."""
    order = sorted(split, key=lambda k: {"learner": 0, "reward": 1}.get(k, 2))
    flat = [k for k in order for _ in range(split[k])]
    return [flat[i * gpus_per_node:(i + 1) * gpus_per_node] for i in range(nodes)]


@dataclass
class PlanConfig:
    """How many rollout / reward / learner (or env / feature) GPUs a target throughput needs, from a short run."""

    run_dir: tyro.conf.Positional[str]
    """A run directory of train llm-policy, ppo-hidden or ppo (its config.json and metrics.jsonl)."""
    target_samples_per_s: float = 0.0
    """The throughput to plan for, in the run's unit: samples (episodes) per second for llm-policy, env steps
    per second for ppo-hidden and ppo."""
    nodes: int | None = None
    """Nodes of the cluster to place the pools on (with --gpus-per-node)."""
    gpus_per_node: int | None = None
    """GPUs per node."""
    utilization: float = 0.9
    """The busy share each pool is planned at (below 1: queues stay short)."""

    def __post_init__(self) -> None:
        check(self.target_samples_per_s > 0, "target_samples_per_s", "give the throughput to plan for (> 0)")
        check((self.nodes is None) == (self.gpus_per_node is None), "nodes", "give --nodes and --gpus-per-node together")
        check(self.nodes is None or (self.nodes >= 1 and self.gpus_per_node >= 1), "nodes", "must be >= 1")
        check(0 < self.utilization <= 1, "utilization", "must be in (0, 1]")


def run(cfg: PlanConfig) -> dict[str, Any]:
    from thinkcraft.utils.metrics import read_metrics, run_metrics_path

    d = Path(cfg.run_dir)
    if not (d / "config.json").is_file():
        raise UserError(f"{d} is not a thinkcraft run directory (no config.json)")
    try:
        config = json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{d / 'config.json'} is not valid JSON ({e})") from None
    metrics = run_metrics_path(d)
    if metrics is None:
        raise UserError(f"{d} has no metrics.jsonl: run a short measured run first (a few logged updates)")
    m = measure(config, read_metrics(metrics))
    p = plan(m, cfg.target_samples_per_s, cfg.nodes, cfg.gpus_per_node, cfg.utilization)
    print(format_plan(p))
    return plan_dict(p)


def plan_dict(p: Plan) -> dict[str, Any]:
    m = p.measured
    return {"job": m.job, "unit": m.unit, "measured_rate": m.rate, "bottleneck": m.bottleneck,
            "pools": {q.name: {"device_s_per_sample": q.device_s_per_sample, "measured_devices": q.measured_devices,
                               "load": m.load(q), "on_gpu": q.on_gpu} for q in m.pools},
            "target": p.target, "gpus": p.gpus, "total_gpus": sum(p.gpus.values()), "cpu_cores": p.cpu_cores,
            "capacity": p.capacity, "fits": p.fits, "best_split": p.best_split, "best_rate": p.best_rate,
            "placement": p.placement, "notes": p.notes}


def format_plan(p: Plan) -> str:
    m = p.measured
    lines = [f"{m.job}: measured {m.rate:,.1f} {m.unit} (median of {m.records_used} records); "
             f"bottleneck: {m.bottleneck}", f"{'pool':<18}{'dev-s/sample':>14}{'devices':>9}{'busy':>7}"
                                                 f"{'for ' + format(p.target, ',.0f'):>12}"]
    for q in m.pools:
        need = f"{p.gpus[q.name]} GPU" if q.on_gpu else f"{p.cpu_cores[q.name]:.1f} cores"
        lines.append(f"{q.name:<18}{q.device_s_per_sample:>14.3g}{q.measured_devices:>9}{m.load(q):>7.0%}{need:>12}")
    lines.append(f"target {p.target:,.0f} {m.unit}: {sum(p.gpus.values())} GPUs "
                 f"({', '.join(f'{k} {v}' for k, v in p.gpus.items())})")
    if p.capacity is not None:
        verdict = "fits" if p.fits else "does not fit"
        idle = (p.capacity or 0) - sum((p.best_split or {}).values())
        lines.append(f"cluster of {p.capacity} GPUs: the target {verdict}; its best split "
                     f"{p.best_split} reaches {p.best_rate:,.1f} {m.unit}" + (f" ({idle} GPUs idle)" if idle > 0 else ""))
        lines += [f"  node {i}: {', '.join(n) or '(idle)'}" for i, n in enumerate(p.placement or [])]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
