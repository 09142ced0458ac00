"""Scale-out (issue 21): throughput on 1, 2, 4 GPUs, each row with its one-GPU reference from the same command.

    python bench/scale.py --jobs ppo --gpus 1 2 4                  # PPO, 1024 envs per GPU (--devices g)
    python bench/scale.py --jobs ppo-hidden --gpus 1 2 4 --skip-n 25 5
    python bench/scale.py --quick                                  # CPU plumbing: 2 forced host devices, tiny shapes

Rows (`bench/results/scale.json`, merged by (job, gpus, skip_n) so that runs of a few rows at a time add up):

* `ppo`: `train ppo --devices g --num-envs 1024·g` (Craftax-Symbolic, num_steps 64, Baselines' defaults), the
  median SPS of the logged chunks after the first (compile); reference: g = 1. Goal: >= 1.9x on 2 GPUs,
  >= 3.6x on 4.
* `ppo-hidden`: 128 envs, skip_n 25 / 5, a Qwen3-4B-shaped random-weight LLM (bench/ppo_hidden_sps.py's
  engine), --overlap. g = 1: env and LLM on GPU 0 (the LLM on a green context of all but 16 SMs); g > 1: the
  env on GPU 0 and g - 1 feature engines on cuda:1..g-1 (llm/sharded.py, what `--feature-devices` builds;
  the engines are built once and passed in). Goal: >= 30,000 SPS at skip 25 on 4 GPUs, >= 10,000 at skip 5.
* `llm-policy`: measured by `bench/async_llm_policy.py --placement dedicated --gpus 2 3 4` (1-3 rollout GPUs
  + 1 learner GPU, rows in async_llm_policy.json); the rows here point there.

Columns: {job, gpus, skip_n, sps (or samples_per_s), one_gpu_reference, speedup, goal, card, date, ...}.
`--quick` writes bench/results/scale_quick.json (CPU numbers are plumbing checks, not results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import card, print_table, today, write_records  # noqa: E402

GOALS = {("ppo", 2): "speedup >= 1.9", ("ppo", 4): "speedup >= 3.6",
         ("ppo-hidden", 4, 25): "sps >= 30000", ("ppo-hidden", 4, 5): "sps >= 10000"}


RATE = {"refresh": "refreshes_per_s", "llm-policy": "samples_per_s"}
"""Each job's rate column (higher is better; default sps) that its one-GPU reference and speedup read."""
REFERENCE_GPUS = {"llm-policy": 2}
"""The reference row's GPU count: one GPU, except llm-policy's (one rollout GPU + the learner's)."""


def steady(run_dir: Path, key: str) -> tuple[float | None, int]:
    """Median of `key` over the logged records after the first (which compiles), and how many."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [r[key] for r in (recs[1:] if len(recs) > 1 else recs) if key in r]
    return (statistics.median(vals) if vals else None), len(vals)


def ppo_row(gpus: int, quick: bool, runs_dir: str, updates: int) -> dict[str, Any]:
    from thinkcraft.train.ppo import PPOConfig, run

    per = 8 if quick else 1024
    chunk = 1 if quick else 4
    cfg = PPOConfig(env_name="craftax-classic" if quick else "Craftax-Symbolic-v1", num_envs=per * gpus,
                    num_steps=8 if quick else 64, layer_width=32 if quick else 512, devices=gpus,
                    optimistic_reset_ratio=2 if quick else 16, updates_per_chunk=chunk,
                    total_timesteps=per * gpus * (8 if quick else 64) * chunk * updates,
                    runs_dir=runs_dir, run_name=f"ppo-g{gpus}", overwrite=True, plot=False,
                    checkpoint_every_minutes=0.0)
    run(cfg)
    sps, n = steady(Path(runs_dir) / f"ppo-g{gpus}", "sps")
    return {"job": "ppo", "gpus": gpus, "skip_n": None, "num_envs": cfg.num_envs, "sps": sps, "records": n}


class EngineCache:
    """One feature engine per slot (a device; on the CPU, several slots share it), built once for every row
    that uses it; a ShardedEngine's restart after a fault builds a fresh one."""

    def __init__(self, quick: bool, backend: str = "local", quantize: str = "none") -> None:
        self.quick, self.engines, self.backend, self.quantize = quick, {}, backend, quantize
        self.ray_engine: tuple[int, Any] | None = None
        """--feature-backend ray: the actors of one GPU count at a time (they hold their GPUs)."""

    def get(self, slot: str, device: str, fresh: bool = False) -> tuple[Any, str]:
        if fresh or slot not in self.engines:
            from ppo_hidden_sps import build_engine

            self.engines[slot] = build_engine(self.quick, device=device, quantize=self.quantize)
        return self.engines[slot]

    def factory(self, slot: str, device: str) -> Any:
        calls = [0]

        def make() -> Any:
            calls[0] += 1
            return self.get(slot, device, fresh=calls[0] > 1)[0]

        return make

    def feature_engine(self, gpus: int) -> tuple[Any, str]:
        """g = 1: the engine on the policy's device; g > 1: g - 1 engines on the other devices, sharded."""
        from thinkcraft.llm.sharded import ShardedEngine

        if gpus == 1:
            return self.get("cpu:0" if self.quick else "cuda:0", "cpu" if self.quick else "cuda:0")
        if self.backend == "ray":
            return self.ray_features(gpus - 1)
        slots = [f"cpu:{k}" if self.quick else f"cuda:{k}" for k in range(1, gpus)]
        devices = ["cpu" if self.quick else s for s in slots]
        sharded = ShardedEngine([self.factory(s, d) for s, d in zip(slots, devices)],
                                gather_device=None if self.quick else "cuda:0", timeout_s=600, retries=1, names=slots)
        return sharded, f"{self.get(slots[0], devices[0])[1]} x {gpus - 1}"


    def ray_features(self, k: int) -> tuple[Any, str]:
        """k Ray feature actors (pools/ray_features.py), one GPU each, the policy's GPU hidden from them."""
        import functools

        from ppo_hidden_sps import engine_on

        from thinkcraft.pools.ray_features import ray_feature_engine
        from thinkcraft.pools.ray_backend import connect

        if self.ray_engine is not None and self.ray_engine[0] != k:
            self.ray_engine[1].close()
            self.ray_engine = None
        if self.ray_engine is None:
            # the actors import bench/ppo_hidden_sps.py (their engine's builder) and thinkcraft
            here = str(Path(__file__).resolve().parent)
            src = str(Path(__file__).resolve().parents[1] / "src")
            env = {"PYTHONPATH": os.pathsep.join(p for p in (src, here, os.environ.get("PYTHONPATH", "")) if p)}
            # the tokenizer, and whether the engines replay graphs
            env.update({k: os.environ[k] for k in ("THINKCRAFT_CACHE", "THINKCRAFT_HIDDEN_GRAPHS") if k in os.environ})
            connect("", hide_device=None if self.quick else "cuda:0", env_vars=env,
                    **({"num_cpus": 2} if self.quick else {}))
            eng = ray_feature_engine(functools.partial(engine_on, quick=self.quick, quantize=self.quantize), k,
                                     gather_device=None if self.quick else "cuda:0", timeout_s=600, retries=1)
            self.ray_engine = (k, eng)
        return self.ray_engine[1], f"Ray actors x {k}"

    def close(self) -> None:
        if self.ray_engine is not None:
            self.ray_engine[1].close()
            import ray

            ray.shutdown()


def ppo_hidden_row(gpus: int, skip_n: int, quick: bool, runs_dir: str, updates: int, engines: EngineCache
                   ) -> dict[str, Any]:
    from thinkcraft.llm.sharded import median_call_ms
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig, run

    engine, desc = engines.feature_engine(gpus)
    num_envs, num_steps = (4, 8) if quick else (128, 100)
    name = f"hidden-g{gpus}-s{skip_n}"
    cfg = PPOHiddenConfig(env_name="craftax-classic" if quick else "Craftax-Symbolic-v1", num_envs=num_envs,
                          num_steps=num_steps, skip_n=skip_n, overlap=True, updates_per_chunk=1,
                          layer_width=32 if quick else 512, hidden_proj_dim=8 if quick else 64,
                          optimistic_reset_ratio=2 if quick else 16, total_timesteps=num_envs * num_steps * updates,
                          runs_dir=runs_dir, run_name=name, overwrite=True, plot=False, checkpoint_every_minutes=0.0)
    before = getattr(engine, "calls", 0)
    run(cfg, engine=engine)
    d = Path(runs_dir) / name
    sps, n = steady(d, "sps")
    row = {"job": "ppo-hidden", "gpus": gpus, "skip_n": skip_n, "num_envs": num_envs, "sps": sps, "records": n,
           "engine": desc, "llm_wait_share": steady(d, "llm/wait_share")[0], "t_llm_s": steady(d, "timing/llm")[0],
           "t_env_s": steady(d, "timing/env_policy")[0]}
    med = median_call_ms(engine, since=before)
    if med:  # the run's sharded refreshes, median (the first update's compiles left out): call and per-engine ms
        row["refresh_call_ms"], row["shard_ms"] = med
    return row


def refresh_row(gpus: int, quick: bool, engines: EngineCache, profile_base: Path | None = None) -> dict[str, Any]:
    """One ppo-hidden refresh alone (no env running beside it): the hidden states of 136 fresh Craftax-Symbolic
    compact texts (128 envs + the reset pool's 8 worlds) after the default instructions, on g = 1: one engine
    on cuda:0; g > 1: g - 1 engines on cuda:1.. (sharded). Says whether the feature engines scale by
    themselves, apart from the training loop around them (2026-11-27: the loop's refresh did not).
    `profile_base`: one more refresh under torch.profiler (`<base>-g<g>.{txt,json}`: the kernels' share of its
    wall time and the top operators; in-process engines only - a Ray actor's kernels run in its own process)."""
    from ppo_hidden_sps import prefill_rate

    from thinkcraft.llm.protocol import Batch
    from thinkcraft.llm.sharded import median_call_ms
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig
    from thinkcraft.train.ppo_hidden.config import make_prompt_prefix

    engine, desc = engines.feature_engine(gpus)
    n = 4 if quick else 136
    env_name = "craftax-classic" if quick else "Craftax-Symbolic-v1"
    prefix, _ = engine.tokenize_batch(Batch([""], prefix=make_prompt_prefix(PPOHiddenConfig(env_name=env_name))))
    calls0 = getattr(engine, "calls", 0)
    summary: dict[str, Any] = {}

    def profile(fn: Any) -> None:
        import torch
        from common import torch_profile

        summary.update(torch_profile(fn, torch.cuda.is_available(), Path(f"{profile_base}-g{gpus}"),
                                     f"refresh, {gpus} GPU(s), {desc}")[1])

    in_process = gpus == 1 or engines.backend != "ray"  # (a Ray actor's kernels run in its own process)
    tok_per_env, tok_s = prefill_rate(engine, env_name, n, prefix,
                                      profile=profile if profile_base is not None and in_process else None)
    ms = 1000.0 * tok_per_env * n / tok_s
    row = {"job": "refresh", "gpus": gpus, "skip_n": None, "num_envs": n, "refresh_ms": ms,
           "refreshes_per_s": 1000.0 / ms, "suffix_tokens_per_env": tok_per_env, "engine": desc}
    if summary:  # the profiled refresh: how much of its wall time the devices' kernels fill, and with what
        row.update(profile_wall_ms=1000.0 * summary["wall_s"], profile_device_busy_frac=summary["device_busy_frac"],
                   profile_kernels=summary["device_kernels"],
                   profile_top_device_ops=summary["top_device_ops"][:8])
    med = median_call_ms(engine, since=calls0, skip=1)  # after prefill_rate's warm-up call (its compiles)
    if med:  # each engine's own ms per call (its shard) against the call's: equal = side by side
        row["refresh_call_ms"], row["shard_ms"] = med
    return row


def llm_policy_rows(path: str | None) -> list[dict[str, Any]]:
    """llm-policy rows from an async bench file (`bench/async_llm_policy.py --placement dedicated --gpus 2 3 4`,
    its `--out`): one row per GPU count (every GPU, the learner's included), its samples/s, the reference = the
    row with one rollout GPU + the learner (gpus 2), and the fraction of linear scaling per rollout GPU added
    (goal >= 0.8 while generation-bound). Without a file: no rows (the bench measures them, not this script)."""
    if not path:
        return []
    recs = [r for r in json.loads(Path(path).read_text()) if r.get("mode") == "async"
            and r.get("placement") == "dedicated" and "error" not in r and not r.get("env_latency_ms")]
    if not any(r["gpus"] == 2 for r in recs):
        raise SystemExit(f"{path}: no dedicated row on 2 GPUs (one rollout GPU + the learner): no reference")
    ref = next(r for r in recs if r["gpus"] == 2)
    rows = []
    for r in sorted(recs, key=lambda r: r["gpus"]):
        if r.get("steady") is False:  # compile time in its window (the bench warned): not a rate to claim
            print(f"{path}: the {r['gpus']}-GPU row has no capture-free whole cycle (steady steps "
                  f"{r.get('steady_steps')}): left out", flush=True)
            continue
        per_gpu = (r["samples_per_s"] / ref["samples_per_s"]) / (r["gpus"] - 1)
        rows.append({"job": "llm-policy", "gpus": r["gpus"], "skip_n": None, "samples_per_s": r["samples_per_s"],
                     "rollout_gpus": r["gpus"] - 1, "batch": r.get("batch"), "of_linear": per_gpu,
                     "pool_backend": r.get("pool_backend"), "weight_update_s": r.get("weight_update_s"),
                     # the learner's rows a pass (the bench's rows without the column ran 16)
                     "micro_batch_size": r.get("micro_batch_size", 16),
                     "source": str(path), "card": r.get("card"), "date": r.get("date"), "quick": False,
                     "goal": "of_linear >= 0.8" if r["gpus"] > 2 else None})
    return rows


def with_references(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """one_gpu_reference, speedup and goal of each row, from the g = 1 row of its job (and skip_n)."""
    ref = {(r["job"], r["skip_n"]): r.get(RATE.get(r["job"], "sps")) for r in rows
           if r["gpus"] == REFERENCE_GPUS.get(r["job"], 1)}
    for r in rows:
        base, rate = ref.get((r["job"], r["skip_n"])), r.get(RATE.get(r["job"], "sps"))
        r["one_gpu_reference"] = base
        r["speedup"] = rate / base if base and rate else None
        r["goal"] = r.get("goal") or GOALS.get((r["job"], r["gpus"], r["skip_n"])) or GOALS.get((r["job"], r["gpus"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", nargs="+", default=["ppo", "ppo-hidden"],
                    choices=["ppo", "ppo-hidden", "refresh", "llm-policy"],
                    help="refresh: ppo-hidden's feature engines alone (one refresh of 136 texts, no env beside it)")
    ap.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU counts (default: 1 2 4 up to those visible)")
    ap.add_argument("--skip-n", type=int, nargs="+", default=[25, 5])
    ap.add_argument("--feature-backend", choices=["local", "ray"], default="local",
                    help="refresh / ppo-hidden on g > 1 GPUs: in-process engines on cuda:1.. (local) or g - 1 Ray "
                         "actors (ray: their own processes; needs Ray)")
    ap.add_argument("--updates", type=int, default=6, help="logged records per row (the first, compiling, is dropped)")
    ap.add_argument("--hidden-graphs", action="store_true",
                    help="refresh / ppo-hidden: the feature engines replay their forwards from CUDA graphs "
                         "(THINKCRAFT_HIDDEN_GRAPHS=1, llm/hf/hidden_graphs.py); rows carry hidden_graphs")
    ap.add_argument("--quantize", choices=["none", "fp8"], default="none",
                    help="refresh / ppo-hidden: the feature engines' decoder matmuls in FP8 (as BENCHMARKS' one-GPU "
                         "ppo-hidden rows); the reference row uses the same engines; rows carry quantize")
    ap.add_argument("--profile-refresh", action="store_true",
                    help="refresh: one more refresh under torch.profiler per in-process row (<out>_refresh_profile-g<g>"
                         ".{txt,json}; the row gets its kernels' busy share and top operators)")
    ap.add_argument("--llm-rows", default=None, metavar="FILE",
                    help="llm-policy: the async bench's rows to read (its --out of a --placement dedicated --gpus 2 3 4 "
                         "run); the llm-policy job measures nothing itself")
    ap.add_argument("--quick", action="store_true", help="CPU plumbing: 2 forced host devices, tiny shapes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:  # before JAX starts: two host devices stand in for two GPUs
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    visible = len(jax.devices())
    gpus = [g for g in (args.gpus or [1, 2, 4]) if g <= visible]
    if 1 not in gpus:
        gpus = [1, *gpus]  # every row's reference is measured in the same command
    skips = [4, 2] if args.quick else args.skip_n
    updates = 3 if args.quick else args.updates
    stamp = {"card": card() + (f" x {visible}" if visible > 1 else ""), "date": today(), "quick": args.quick}
    if args.hidden_graphs:  # read by every engine this process (or its Ray actors: `ray_features`) builds
        os.environ["THINKCRAFT_HIDDEN_GRAPHS"] = "1"
        stamp["hidden_graphs"] = True
    if args.quantize != "none":
        stamp["quantize"] = args.quantize
    out = args.out or str(Path(__file__).parent / "results" / ("scale_quick.json" if args.quick else "scale.json"))
    rows: list[dict[str, Any]] = []
    profile_base = Path(out).with_name(Path(out).stem + "_refresh_profile") if args.profile_refresh else None

    def add(row: dict[str, Any]) -> None:  # each row written as soon as it is measured: a cut run keeps it
        rows.append(row)
        print("row:", {k: row.get(k) for k in ("job", "gpus", "skip_n", "num_envs", "sps", "records")}, flush=True)
        # (rows read from another run's file keep that run's card and date)
        write_records(out, [{**stamp, **r} for r in with_references(rows)],
                      merge_keys=("job", "gpus", "skip_n", "feature_backend", "pool_backend", "batch", "hidden_graphs",
                                  "quantize", "micro_batch_size"))

    with tempfile.TemporaryDirectory() as runs_dir:
        if "ppo" in args.jobs:
            for g in gpus:
                add(ppo_row(g, args.quick, runs_dir, updates))
        engines = EngineCache(args.quick, args.feature_backend, args.quantize)
        # rows of Ray actors (g > 1) are kept apart from the in-process ones (no column: in-process)
        tag = {"feature_backend": "ray"} if args.feature_backend == "ray" else {}
        try:
            if "refresh" in args.jobs:  # first: seconds, and it warms every engine the ppo-hidden rows use
                for g in gpus:
                    add({**refresh_row(g, args.quick, engines, profile_base), **(tag if g > 1 else {})})
            if "ppo-hidden" in args.jobs:
                for s in skips:
                    for g in gpus:
                        add({**ppo_hidden_row(g, s, args.quick, runs_dir, updates, engines), **(tag if g > 1 else {})})
        finally:
            engines.close()
    if "llm-policy" in args.jobs:
        for r in llm_policy_rows(args.llm_rows):
            add(r)
    rows = [{**stamp, **r} for r in with_references(rows)]
    print_table(rows, ["job", "gpus", "skip_n", "num_envs", "sps", "refresh_ms", "samples_per_s", "one_gpu_reference",
                       "speedup", "of_linear", "goal"])
    print("wrote", out)

if __name__ == "__main__":
    main()
