"""Asynchronous vs synchronous llm-policy (GRPO) at the same hyperparameters: samples/s, s/step, GPU idle
share, reward against trained samples (one PNG), with and without a slow env.

    # CPU plumbing check (tiny random model; seconds):
    .venv/bin/python bench/async_llm_policy.py --quick
    # one GPU: sync vs async (η = 1) on arith and a GSM8K-layout task; then the 200 ms env with N workers
    .venv/bin/python bench/async_llm_policy.py --gpus 1      # (or in parts: --tasks arith --cases base, ...)
    # two GPUs: async with an engine on each GPU (the learner time-sliced with the engine on cuda:0);
    # `--gpus 1 2` measures both placements beside one sync reference
    CUDA_VISIBLE_DEVICES=0,1 .venv/bin/python bench/async_llm_policy.py --gpus 2
    # 1, 2, 3 rollout GPUs + 1 learner GPU (issue 21: samples/s per added rollout GPU), on a 4-GPU machine
    .venv/bin/python bench/async_llm_policy.py --tasks arith --cases base --gpus 2 3 4 --placement dedicated
    # the same with each engine a Ray actor, its own process (no interpreter lock shared with the learner's)
    .venv/bin/python bench/async_llm_policy.py --tasks arith --cases base --gpus 2 3 --placement dedicated --pool-backend ray
    # the CPU learning check of issue 20: the bundled model on arith, async η = 1, 30 steps (about an hour here)
    .venv/bin/python bench/async_llm_policy.py --learning-check

Placement (`--gpus`): sync always runs on one GPU (generate, then train, on cuda:0: today's loop, the
reference, measured in the same command as the async rows). Its slow env sleeps once per batched step (all
episodes' envs step together: the case most favourable to sync); async envs sleep per group step. Async on one GPU: one engine sharing the learner's weights on cuda:0 (generation and training
take turns; env steps, rewards and the next batch's prompts overlap them). Async on two GPUs: engines on
cuda:0 (shared with the learner, time-sliced) and cuda:1 (a copy, updated after every step), so generation
uses both GPUs while the learner trains on cuda:0. `--placement dedicated`: the learner alone on cuda:0 and
G - 1 engine copies on cuda:1..G-1, each updated after every step (the rollout-scaling layout of issue 21).
`--placement copies`: G engine copies on cuda:0..G-1 (bf16, updated after every step), the learner beside the one
on cuda:0: no engine stops for an update (the shared engine does: the learner holds its weights), at the cost of
a copy's memory and its update; on one GPU, generation and training overlap on the same device.

Model (GPU): the Qwen2.5-0.5B body with random weights and a 2,048-token BPE (the TRL comparison shape of
bench/grpo_arith.py), LoRA. Rewards of a random model are ~0, so reward curves say little there; the speed
rows are what the GPU run is for (the CPU learning check shows that async learns).

Engines: the sync reference runs the hf engine's continuous batching (each episode submitted on its own, its
KV kept between turns, the system prompt's KV shared). The async front (`--gen-batching`, default auto =
continuous with hf engines) submits every worker's turn to the engine's running decode batch at once and
hands it back as soon as it ends (a group's turns stay on one engine, which keeps their KV); `whole` batches
whole `generate` calls over the waiting rows instead (the η = 0 reproduction of the sync loop). Slow env:
with continuous batching a group's env step overlaps the other groups' decoding; with whole calls, workers
whose rows all fit one engine batch step their envs in lockstep and the engine waits env / (env + generate)
of the time.

Metrics per run (steady state: the first update, which pays warm-up, is left out): samples_per_s =
trained trajectories / wall seconds; s_per_step = median seconds per update; gpu_idle_share = sync:
1 - (generate + train) / step (the loop's own phase times), async: the loop's `gpu/idle_share` (per device,
1 - (engine generate time + learner update time on it) / wall). Writes bench/results/async_llm_policy.json
rows {task, mode, gpus, env_latency_ms, max_staleness, rollout_workers, samples_per_s, s_per_step,
gpu_idle_share, reward_final, card, date} (merged by task/mode/gpus/latency/η) and the curves PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import card, decode_graphs_column, decode_means, print_table, today, write_records  # noqa: E402


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", choices=range(1, 9), default=[1], metavar="G",
                   help="async placements to measure beside the one sync reference (`--gpus 1 2`)")
    p.add_argument("--placement", choices=["shared", "dedicated", "copies"], default="shared",
                   help="async on G GPUs: shared = engines on cuda:0..G-1, the one on cuda:0 sharing the learner's "
                        "weights; dedicated = the learner alone on cuda:0, engine copies on cuda:1..G-1 (G >= 2); "
                        "copies = engine copies on cuda:0..G-1, the learner beside the one on cuda:0 (G >= 1: "
                        "generation never waits for an update)")
    p.add_argument("--ray-weight-groups", choices=["per-engine", "shared"], default="per-engine",
                   help="--pool-backend ray: an NCCL group per engine (the default since 2026-11-28) or one shared "
                        "broadcast group (its first update waits for every engine's running batch)")
    p.add_argument("--pool-backend", choices=["local", "ray"], default="local",
                   help="async engines as threads of this process (local) or Ray actors (ray: with --placement "
                        "dedicated, G - 1 engine actors on GPUs 1..G-1, the learner on cuda:0; needs thinkcraft[ray])")
    p.add_argument("--model", default="random:qwen2.5-0.5b")
    p.add_argument("--tasks", default="arith,gsm8k", help="comma-separated: arith, gsm8k (a GSM8K-layout file)")
    p.add_argument("--gsm8k-path", default=None, help="a GSM8K-layout JSONL (default: one written from arith problems)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompts-per-engine", type=int, default=None, metavar="N",
                   help="weak scaling (issue 21's rollout-GPU rows): each row's batch is N prompts per rollout engine "
                        "(sync: N; async: N x its engines), so every engine has the same load whatever the count; "
                        "default: --prompts for every row (the same hyperparameters)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--offpolicy", choices=["none", "decoupled", "tis"], default="none",
                   help="the async runs' off-policy correction (the sync rows use none: on-policy, ratio 1)")
    p.add_argument("--rollout-workers", type=int, default=None, help="default (η + 1) x prompts")
    p.add_argument("--slow-env-ms", type=float, default=200.0, help="the slow-env case's latency per step")
    p.add_argument("--cases", default="base,slow", help="base (each task, no latency), slow (first task, slow env)")
    p.add_argument("--slow-env-workers", type=int, default=None,
                   help="rollout workers in the slow-env case, N (default (η + 1) x prompts: every group the "
                        "staleness bound admits runs at once; more would idle)")
    p.add_argument("--finetune", choices=["lora", "full"], default=None,
                   help="default: full for a random-weight shape (bench/grpo_arith.py's GPU reference), lora otherwise")
    p.add_argument("--lr", type=float, default=None, help="default: 1e-6 full, 2e-4 LoRA")
    p.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="static KV cache + compiled decode step (default: on with a GPU, as the sync reference)")
    p.add_argument("--micro-batch-size", type=int, default=16,
                   help="rows per learner micro-batch, both loops (grpo_arith.py's reference: 16, i.e. 4 forward/backward "
                        "passes an update of 64 samples; 0 = the token budget alone decides: one pass of ~50k tokens)")
    p.add_argument("--learner-compile", action="store_true",
                   help="torch.compile the learner's packed forward, both loops (LLMPolicyConfig.learner_compile)")
    p.add_argument("--max-generate-batch", type=int, default=1024, help="rows per engine batch (both loops)")
    p.add_argument("--gen-batching", choices=["auto", "continuous", "whole"], default="auto",
                   help="the async front's batching (train llm-policy --gen-batching)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CPU plumbing check: tiny model, 3 steps, 50 ms env")
    p.add_argument("--learning-check", action="store_true",
                   help="the bundled model on arith, async η = 1, 30 steps (CPU): does reward rise?")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="probe: the interpreter's GIL switch interval (sys.setswitchinterval; Python's default 5 ms): "
                        "how long a thread waiting for the GIL lets a running one go on before asking it to yield")
    p.add_argument("--profile-steady", type=float, default=0.0, metavar="SECONDS",
                   help="py-spy this process for SECONDS once each run's first update is done (bench/steady_profile.py): "
                        "per-thread summary in <out>_profile.json")
    p.add_argument("--sync-reference", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the sync loop (one GPU) before the async rows of the base case; --no-sync-reference "
                        "for a diagnosis run only (its async rows have no reference of the same run: not a result)")
    p.add_argument("--out", default=None)
    p.add_argument("--rederive", default=None, metavar="JSON",
                   help="recompute JSON's rows from the per-update records kept beside it (<stem>.metrics/), "
                        "with this version's steady window; runs nothing")
    a = p.parse_args(argv)
    if a.quick:
        a.model, a.tasks, a.steps, a.prompts, a.samples, a.max_new_tokens = "random:tiny", "arith,gsm8k", 3, 2, 2, 8
        a.rollout_workers, a.slow_env_ms, a.slow_env_workers, a.micro_batch_size = 4, 50.0, 8, 4
    if a.learning_check:
        a.model, a.tasks, a.steps, a.prompts, a.samples, a.max_new_tokens = "default", "arith", 30, 8, 4, 96
        a.rollout_workers, a.micro_batch_size = 8, 16
    if a.finetune is None:
        a.finetune = "full" if a.model.startswith("random:") and not a.quick else "lora"
    if a.lr is None:
        a.lr = 1e-6 if a.finetune == "full" else 2e-4
    if a.prompts_per_engine is not None and a.prompts_per_engine < 1:
        p.error("--prompts-per-engine must be >= 1")
    a.workers_given = a.rollout_workers is not None
    if a.rollout_workers is None:
        a.rollout_workers = (a.max_staleness + 1) * a.prompts
    if a.slow_env_workers is None:
        a.slow_env_workers = (a.max_staleness + 1) * a.prompts
    if a.compile_decode is None:
        import torch

        a.compile_decode = torch.cuda.is_available()
    return a


def gsm8k_layout_file(path: Path, n: int = 512) -> Path:
    """A GSM8K-layout JSONL (question, worked answer ending in '#### <n>') from arith problems of difficulty
    3 (three operations): the gsm8k env's code path with nothing downloaded."""
    from thinkcraft.envs.textenvs import ArithTask

    task = ArithTask(3)
    with open(path, "w", encoding="utf-8") as f:
        for s in range(n):
            p = task.problem(10_000 + s)
            f.write(json.dumps({"question": p.question, "answer": f"Work it out step by step.\n#### {p.answer}"}) + "\n")
    return path


def rollout_scaling(rows: list[dict]) -> list[str]:
    """Issue 21's rollout-GPU scaling of the dedicated rows (the learner on a GPU of its own): each row's
    samples/s against the row with the fewest rollout GPUs (the reference: 1 rollout GPU + the learner), per
    rollout GPU added: (s_g / s_ref) / (r_g / r_ref) with r = gpus - 1 (goal >= 0.8 while generation-bound)."""
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        ded = sorted((r for r in rows if r["task"] == task and r.get("placement") == "dedicated"
                      and r["mode"] == "async" and not r["env_latency_ms"]), key=lambda r: r["gpus"])
        if len(ded) < 2:
            continue
        ref = ded[0]
        for r in ded[1:]:
            eff = (r["samples_per_s"] / ref["samples_per_s"]) / ((r["gpus"] - 1) / (ref["gpus"] - 1))
            out.append(f"{task}: {r['gpus'] - 1} rollout GPUs (batch {r.get('batch')}) vs {ref['gpus'] - 1} "
                       f"(batch {ref.get('batch')}): {r['samples_per_s']:.2f} vs {ref['samples_per_s']:.2f} "
                       f"samples/s = {eff:.2f} of linear")
    return out


def _prompts(a, mode: str, gpus: int) -> int:
    """Prompts per step of a row: --prompts, or with --prompts-per-engine N, N per rollout engine (sync: one
    engine; async shared: one per GPU; dedicated: one per GPU but the learner's)."""
    if a.prompts_per_engine is None:
        return a.prompts
    engines = 1 if mode == "sync" else gpus - (1 if a.placement == "dedicated" else 0)  # copies: one per GPU
    return a.prompts_per_engine * engines


def _config(a, task: str, mode: str, latency_ms: float, gpus: int, run_dir: Path, gsm8k_path: str | None):
    import torch

    from thinkcraft.train.llm_policy import LLMPolicyConfig

    kw: dict = {}
    prompts = _prompts(a, mode, gpus)
    if mode == "async":
        workers = a.slow_env_workers if latency_ms else a.rollout_workers
        if a.prompts_per_engine is not None and not a.workers_given and not latency_ms:
            workers = (a.max_staleness + 1) * prompts  # every group the staleness bound admits runs at once
        kw = dict(mode="async", max_staleness=a.max_staleness, rollout_workers=workers, offpolicy=a.offpolicy,
                  gen_batching=a.gen_batching)
        first = 1 if a.placement == "dedicated" else 0
        if a.pool_backend == "ray":  # the backend places its engines: one actor per rollout GPU
            kw.update(pool_backend="ray", ray_engines=gpus - first, ray_weight_groups=a.ray_weight_groups)
        elif a.placement == "copies":  # every engine a copy, the one on the learner's device too
            kw["weight_sync"] = "copy"
            kw["rollout_devices"] = ",".join(f"cuda:{k}" for k in range(gpus)) if torch.cuda.is_available() else "cpu"
        elif gpus > 1:
            kw["rollout_devices"] = ",".join(f"cuda:{k}" for k in range(first, gpus))
    # the learner on cuda:0 by name, as the rows say (llm-policy's "auto" is cuda:0 too since 2026-11-29; before,
    # it followed the current GPU, which a run earlier in this process had left on cuda:1: a "dedicated" row's
    # learner shared its engine's GPU)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    return LLMPolicyConfig(
        env=task, algo="grpo", model=a.model, run_dir=str(run_dir), device=device, steps=a.steps, prompts_per_step=prompts,
        group_size=a.samples, max_new_tokens=a.max_new_tokens, lr=a.lr, finetune=a.finetune, format_weight=0.1,
        kv_cache="static" if a.compile_decode else "dynamic", compile_decode=a.compile_decode,
        max_generate_batch=a.max_generate_batch,
        lenient_answer=False, micro_batch_size=a.micro_batch_size, learner_compile=a.learner_compile, seed=a.seed,
        checkpoint_every=0,
        store=False, plot=False, log_every_s=30.0, gsm8k_path=gsm8k_path if task == "gsm8k" else None,
        env_latency_ms=latency_ms, **kw,
    )


def _window_start(recs: list[dict]) -> int:
    """Index of the first record after the first step and after the last step that captured a decode graph."""
    captured = [i for i, r in enumerate(recs) if r.get("engine/graph_captures", 0.0) > 0]
    return max(1, captured[-1] + 1 if captured else 1)


def _is_steady(recs: list[dict], max_staleness: int) -> bool:
    """Do the records hold at least one whole cycle (η + 1 steps) after the warm-up and the last capture? A row
    without one (`steady: false`) counts compile time or a partial cycle: not a rate to compare."""
    return len(recs) - _window_start(recs) >= max_staleness + 1


def _steady(recs: list[dict], max_staleness: int) -> list[dict]:
    """The steady steps: all but the first (it compiles), cut from the front to a multiple of η + 1 steps.
    Why: on one GPU the async loop runs in cycles of η + 1 updates - one that generates the next batches
    while the learner waits for the engine it shares, then updates that only train what is buffered - so a
    window of a partial cycle over-weights one kind (2026-11-27, gsm8k, 4 steps: a 3-step window with two
    train-only steps read 1.93x sync; the balanced arith windows read 1.36x).
    A later step that compiled and captured a decode graph (`engine/graph_captures` > 0: a new width or prefix,
    ~40 s) ends the warm-up there too: 2026-11-28 (4 x H200) a Ray engine's third capture in step 3 (44 s) made
    a 6-step row read 4.43 samples/s where its capture-free steps ran 17.3."""
    start = _window_start(recs)
    if start >= len(recs):
        print(f"warning: step {recs[-1]['step']} still compiled a decode graph: no capture-free steady step; the "
              "rows' rate counts compile time (run more --steps)", file=sys.stderr, flush=True)
        start = 1
    elif start > 1:
        print(f"note: the steady window starts at step {recs[start]['step']}, after the last decode-graph capture "
              f"(step {recs[start - 1]['step']})", file=sys.stderr, flush=True)
    steady = recs[start:] or recs
    cycle = max_staleness + 1
    if cycle > 1 and len(steady) >= cycle:
        steady = steady[len(steady) % cycle:]
    elif cycle > 1:
        print(f"warning: {len(steady)} steady step(s) is less than one async cycle (η + 1 = {cycle}): "
              "the samples/s of this row is not a steady rate; run more --steps", file=sys.stderr, flush=True)
    return steady


def _median_or_none(values) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 4) if vals else None


def _measure(a, cfg, mode: str, profile=None) -> dict:
    from thinkcraft.train.llm_policy import run
    from thinkcraft.utils.metrics import read_metrics

    t0 = time.time()
    with profile or contextlib.nullcontext():
        run(cfg)
    recs = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    return {**_summarise(recs, mode, cfg.max_staleness, cfg.prompts_per_step * cfg.group_size),
            "wall_s": time.time() - t0}


def _summarise(recs: list[dict], mode: str, max_staleness: int, batch: int) -> dict:
    """A run's row metrics from its per-update records (also `--rederive`: rows again from kept records)."""
    steady = _steady(recs, max_staleness if mode == "async" else 0)
    wall = sum(r["timing/step"] for r in steady)
    if mode == "sync":
        idle = [1.0 - (r.get("timing/generate", 0.0) + r.get("timing/train", 0.0)) / r["timing/step"] for r in steady]
    else:
        idle = [r["gpu/idle_share"] for r in steady]
    k = max(1, min(5, len(recs) // 3))
    return {
        "samples_per_s": batch * len(steady) / wall, "s_per_step": statistics.median(r["timing/step"] for r in steady),
        "gpu_idle_share": statistics.mean(idle), "reward_final": statistics.mean(r["reward/mean"] for r in recs[-k:]),
        "reward_first": statistics.mean(r["reward/mean"] for r in recs[:k]),
        "curve": [(batch * r["step"], r["reward/mean"]) for r in recs],
        "staleness_mean": statistics.mean(r.get("staleness/mean", 0.0) for r in steady),
        "steady_steps": [int(r["step"]) for r in steady],
        "steady": _is_steady(recs, max_staleness if mode == "async" else 0),
        "failed": recs[-1].get("rollout/failed", 0),
        # decode graphs compiled + captured over the whole run (first steps included) and their seconds
        "graph_captures": sum(r.get("engine/graph_captures", 0.0) for r in recs),
        "graph_capture_s": round(sum(r.get("engine/graph_capture_s", 0.0) for r in recs), 1),
        # the longest time no Python thread could run (async loop only: utils.watchdog.GilProbe)
        "gil_lag_max_s": round(max((r.get("perf/gil_lag_max_s", 0.0) for r in recs), default=0.0), 3),
        # seconds per weight update of an engine with its own copy (copy + load; None: every engine shared)
        "weight_update_s": _median_or_none(r.get("weights/update_s") for r in recs[1:]),
        # the switch's prefix KV by a graph replay (prefix_graph.py; THINKCRAFT_PREFIX_GRAPH=0: eager), whole run
        "prefix_graph_replays": sum(r.get("engine/prefix_graph_replays", 0.0) for r in recs),
        "prefix_graph_failed": max((r.get("engine/prefix_graph_failed", 0.0) for r in recs), default=0.0),
        # engines whose one-pass sampler served (fused_sampler.py; THINKCRAFT_FUSED_SAMPLER=0: none)
        "fused_sampler": max((r.get("engine/fused_sampler", 0.0) for r in recs), default=0.0),
        # engines whose decode attention ran split-KV (split_decode.py; THINKCRAFT_SPLIT_DECODE=0: none)
        "split_decode": max((r.get("engine/split_decode", 0.0) for r in recs), default=0.0),
        # ... and the engine's phases inside it, per step of the steady window (seconds the engine stood still)
        **{k.split("/")[1]: _median_or_none(r.get(k) for r in steady)
           for k in ("engine/weight_drain_s", "engine/weight_copy_s", "engine/weight_switch_s")},
        # the engines' decode loop (host included) and its batch: a host-bound loop shows here, not in idle shares
        **decode_means(steady),
        **{k.split("/")[1]: statistics.median(r[k] for r in steady) for k in ("timing/generate", "timing/train")
           if all(k in r for r in steady)},
        # async: a group's admission to its finish (the generation it waited for), and its finish to its batch's
        # hand-over (waiting for the batch's last group, or for the learner): async_loop.batch_timeline
        **{k.split("/")[1]: round(statistics.median(r[k] for r in steady), 3)
           for k in ("rollout/group_latency_s", "rollout/group_latency_max_s", "rollout/group_wait_s")
           if all(k in r for r in steady)},
    }


def _keep_metrics(run_dir: str, out: Path) -> None:
    """The run's per-update records (queue depths, busy and idle shares, rows per decode step, staleness) kept
    beside the rows, gzipped, as <out stem>.metrics/<run name>.jsonl.gz: a device run's temporary run dir is
    gone with the machine, and a row's medians do not say when the pools waited for each other (2026-11-28:
    a 2-GPU run whose generation and updates stopped overlapping left nothing to read that from)."""
    import gzip
    import shutil

    src = Path(run_dir) / "metrics.jsonl"
    if not src.exists():
        return
    dst = out.parent / f"{out.stem}.metrics" / f"{Path(run_dir).name}.jsonl.gz"
    dst.parent.mkdir(parents=True, exist_ok=True)
    with src.open("rb") as f, gzip.open(dst, "wb") as g:
        shutil.copyfileobj(f, g)


def _plot(rows: list[dict], out_png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for r in (r for r in rows if "curve" in r):
        xs, ys = zip(*r["curve"])
        label = f"{r['task']} {r['mode']} gpus={r['gpus']} env={r['env_latency_ms']:g}ms"
        if r["mode"] == "async":
            label += f" η={r.get('max_staleness')} {r.get('offpolicy', 'none')}"
        ax.plot(xs, ys, marker=".", linestyle="-" if r["mode"] == "async" else "--", label=label)
    ax.set_xlabel("trained samples")
    ax.set_ylabel("reward/mean")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def _merged_rows(out: Path, rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """This run's rows plus the file's earlier rows of other keys (what write_records will keep)."""
    old = json.loads(out.read_text()) if out.exists() else []
    new = {tuple(r.get(k) for k in keys) for r in rows}
    return [r for r in old if tuple(r.get(k, OLD_ROW_DEFAULTS.get(k)) for k in keys) not in new] + rows


OLD_ROW_DEFAULTS = {"offpolicy": "none", "gen_batching": "whole"}
"""What rows written before a key existed ran with (the async front batched whole calls until it had a choice)."""


def _sync_reference(a) -> list[dict]:
    """The synchronous loop's curve at the same hyperparameters, from bench/grpo_arith.py's CPU run (30 steps,
    8 x 4, 96 tokens, lr 2e-4, format 0.1), when that file is there."""
    p = ROOT / "bench" / "results" / "grpo_arith.json"
    if not p.exists():
        return []
    d = json.loads(p.read_text())
    s = d["summary"]
    if (s.get("prompts"), s.get("samples"), s.get("max_new_tokens"), s.get("model")) != (a.prompts, a.samples,
                                                                                         a.max_new_tokens, "default"):
        return []
    batch = a.prompts * a.samples
    return [{"task": "arith", "mode": "sync", "gpus": 1, "env_latency_ms": 0.0,
             "curve": [(batch * r["step"], r["reward_mean"]) for r in d["steps"]]}]


class _EagerFallbacks(logging.Handler):
    """Counts the engine's "compiled ... unavailable; running eager" warnings (one per failed compile) and
    keeps their texts: the row says why (the two-GPU run of 2026-11-27 had 2 and nothing said which)."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.reasons: list[str] = []  # of the configuration being measured (`reasons.clear()` between them)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "unavailable" in msg:
            self.reasons.append(f"[{record.threadName}] {msg[:400]}")
            print(f"eager fallback: {self.reasons[-1]}", file=sys.stderr, flush=True)

    @classmethod
    def install(cls) -> "_EagerFallbacks":
        h = cls(logging.WARNING)
        logging.getLogger("thinkcraft.llm.hf").addHandler(h)
        # each decode-graph capture as it happens (device, width, seconds): a first step that takes minutes
        # shows whether compiles are the time, even when the job is cut before any row
        from thinkcraft.llm.hf.cache import log_cache_events

        log_cache_events()
        return h


def _plan(a) -> list[tuple[str, str, float, int]]:
    """(task, mode, env latency, gpus) runs: sync (one GPU) and async on each of --gpus per task; the slow env
    on the first task (async on the fewest GPUs: the idle-share goal is about workers, not placement)."""
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    if a.learning_check:
        return [("arith", "async", 0.0, 1)]
    cases = {c.strip() for c in a.cases.split(",")}
    plan = []  # the sync reference (one GPU) runs in the same command as the async rows it is compared with
    for i, t in enumerate(tasks):  # the first task's cases first (each row is written as soon as it is measured)
        if "base" in cases:
            if a.sync_reference:
                plan.append((t, "sync", 0.0, 1))
            plan += [(t, "async", 0.0, g) for g in sorted(set(a.gpus))]
        if i == 0 and "slow" in cases and a.slow_env_ms:
            plan += [(t, "sync", a.slow_env_ms, 1), (t, "async", a.slow_env_ms, min(a.gpus))]
    return plan


def rederive(path: Path) -> list[dict]:
    """The rows of `path` recomputed from the per-update records kept beside them (`_keep_metrics`) with
    today's `_summarise` (e.g. a steady window that changed); rows without kept records are left as they are.
    Writes the file back and returns the rows."""
    import gzip

    rows = json.loads(path.read_text())
    for r in rows:
        f = path.parent / f"{path.stem}.metrics" / f"{r['task']}-{r['mode']}-{r['env_latency_ms']:g}-{r['gpus']}.jsonl.gz"
        if "error" in r or not f.exists():
            continue
        with gzip.open(f, "rt") as g:
            recs = [json.loads(line) for line in g if line.strip()]
        before = r["samples_per_s"]
        r.update(_summarise(recs, r["mode"], r["max_staleness"], r["batch"]))
        print(f"{f.name}: samples/s {before:.2f} -> {r['samples_per_s']:.2f} (steady steps {r['steady_steps']})")
    path.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def main(argv=None) -> int:
    a = _args(argv)
    if a.rederive:
        rederive(Path(a.rederive))
        return 0
    if a.placement == "dedicated" and min(a.gpus) < 2:
        raise SystemExit("--placement dedicated needs --gpus of 2 or more (the learner has cuda:0 to itself)")
    if a.pool_backend == "ray" and a.placement != "dedicated":
        raise SystemExit("--pool-backend ray needs --placement dedicated (Ray places engines on GPUs of their own; "
                         "the learner keeps cuda:0)")
    import torch

    if not torch.cuda.is_available():
        # one intra-op thread: on a small shared CPU, a main thread's 2-thread OpenMP regions ran ~10x slower than
        # the same work on a worker thread (spin-waits under load), which would flatter async for the wrong reason
        torch.set_num_threads(1)
    if a.switch_interval_ms is not None:
        sys.setswitchinterval(a.switch_interval_ms / 1000.0)
    tmp = Path(tempfile.mkdtemp(prefix="async_llm_policy-"))
    gsm = a.gsm8k_path or str(gsm8k_layout_file(tmp / "gsm8k_layout.jsonl"))
    keys = ("task", "mode", "gpus", "env_latency_ms", "max_staleness", "offpolicy", "gen_batching", "switch_interval_ms",
            "decode_graphs", "placement", "pool_backend", "ray_weight_groups", "batch", "micro_batch_size",
            "learner_compile")
    name = "async_llm_policy" + ("_quick" if a.quick else "_cpu_learning" if a.learning_check else "")
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"{name}.json"
    fallbacks = _EagerFallbacks.install()
    rows = []
    for task, mode, latency, gpus in _plan(a):
        fallbacks.reasons.clear()
        cfg = _config(a, task, mode, latency, gpus, tmp / f"{task}-{mode}-{latency:g}-{gpus}", gsm)
        try:
            prof = None
            if a.profile_steady > 0:
                from steady_profile import SteadyProfile, metrics_reached

                prof = SteadyProfile(metrics_reached(cfg.run_dir, 1), out.with_name(out.stem + "_profile.json"),
                                     f"{task}-{mode}-{latency:g}ms-{gpus}gpu", seconds=a.profile_steady)
            m = _measure(a, cfg, mode, prof)
        except Exception as e:  # noqa: BLE001 - one failed configuration must not lose the others' rows
            print(f"{task} {mode} gpus={gpus} env={latency:g}ms FAILED: {type(e).__name__}: {e}", flush=True)
            rows.append({"task": task, "mode": mode, "gpus": gpus, "env_latency_ms": latency,
                         "max_staleness": a.max_staleness if mode == "async" else 0, "error": f"{type(e).__name__}: {e}",
                         "batch": cfg.prompts_per_step * cfg.group_size,
                         "card": card(), "date": today()})
            write_records(out, rows[-1:], merge_keys=keys)
            continue
        rows.append({"task": task, "mode": mode, "gpus": gpus, "env_latency_ms": latency,
                     "max_staleness": a.max_staleness if mode == "async" else 0,
                     "offpolicy": a.offpolicy if mode == "async" else "none",
                     # auto resolves to continuous: the bench's engines are in-process hf engines
                     "gen_batching": cfg.gen_batching.replace("auto", "continuous") if mode == "async" else None,
                     "placement": a.placement if mode == "async" else None,
                     # None: threads of this process (every row before the flag), "ray": engine actors
                     "pool_backend": "ray" if mode == "async" and a.pool_backend == "ray" else None,
                     # None: not Ray; rows before 2026-11-28's per-engine default used the shared group
                     "ray_weight_groups": a.ray_weight_groups if mode == "async" and a.pool_backend == "ray" else None,
                     "rollout_workers": cfg.rollout_workers if mode == "async" else None, "model": a.model,
                     "steps": a.steps, "batch": cfg.prompts_per_step * cfg.group_size, "max_new_tokens": a.max_new_tokens,
                     "finetune": a.finetune, "compile_decode": a.compile_decode,
                     # the learner's passes an update (rows without the column ran 16)
                     "micro_batch_size": a.micro_batch_size, "learner_compile": a.learner_compile or None,
                     # a compiled decode step that fell back to eager makes a row slow for the wrong reason
                     "eager_fallbacks": len(fallbacks.reasons), "eager_fallback_reasons": list(fallbacks.reasons),
                     "switch_interval_ms": a.switch_interval_ms,  # None: Python's default (5 ms)
                     "decode_graphs": decode_graphs_column(),
                     **m, "card": card(), "date": today()})
        print(f"{task} {mode} gpus={gpus} env={latency:g}ms: {m['samples_per_s']:.2f} samples/s, {m['s_per_step']:.2f} s/step, "
              f"GPU idle {100 * m['gpu_idle_share']:.0f}%, reward {m['reward_first']:.3f} -> {m['reward_final']:.3f}, "
              f"decode graphs captured {m['graph_captures']:.0f} ({m['graph_capture_s']:.0f} s), "
              f"longest GIL stall {m['gil_lag_max_s']:.2f} s"
              + (f", weight update {m['weight_update_s']:.3f} s" if m.get("weight_update_s") is not None else "")
              + (f", group latency {m['group_latency_s']:.2f} s (max {m['group_latency_max_s']:.2f}), waited "
                 f"{m['group_wait_s']:.2f} s for its batch" if "group_latency_s" in m else ""),
              flush=True)
        write_records(out, rows[-1:], merge_keys=keys)  # each row as soon as it is measured (a cut run keeps it)
        _keep_metrics(cfg.run_dir, out)
    if a.learning_check:  # every async run of the file so far (e.g. each correction) beside the sync reference
        rows_plot = _merged_rows(out, rows, keys) + _sync_reference(a)
        _plot(rows_plot, out.with_suffix(".png"), f"GRPO on arith, bundled model: async η={a.max_staleness} vs sync "
                                                  f"({card()})")
    else:
        _plot(rows, out.with_suffix(".png"), f"GRPO sync vs async (η={a.max_staleness}), {a.model}, {card()}")
    write_records(out, rows, merge_keys=keys)
    ok = [r for r in rows if "error" not in r]
    print_table(ok, ["task", "mode", "gpus", "batch", "env_latency_ms", "max_staleness", "rollout_workers", "samples_per_s",
                     "s_per_step", "gpu_idle_share", "reward_final"])
    for r in ok:  # async speed-up against sync at the same task and latency
        ref = next((s for s in ok if s["mode"] == "sync" and s["task"] == r["task"]
                    and s["env_latency_ms"] == r["env_latency_ms"]), None)
        if r["mode"] == "async" and ref:
            print(f"{r['task']} env={r['env_latency_ms']:g}ms: async ({r['gpus']} GPU) / sync (1 GPU) samples/s = "
                  f"{r['samples_per_s'] / ref['samples_per_s']:.2f}x")
    for line in rollout_scaling(ok):
        print(line)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    shutil.rmtree(tmp, ignore_errors=True)
    if len(ok) < len(rows):  # a failed case is in its row's `error` and above; the exit status says so too
        print(f"{len(rows) - len(ok)} of {len(rows)} cases failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
