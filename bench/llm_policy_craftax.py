"""Craftax llm-policy at engine speed: continuous batching, turn-KV reuse, the compiled decode step.

    # GPU (one H100): the issue-19 grid - Qwen2.5-0.5B and Qwen3-4B shapes (random weights, a 2,048-token BPE
    # trained on Craftax observations), 64 / 256 envs, 32-token actions, no thinking / a 256-token budget
    python bench/llm_policy_craftax.py
    python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0   # the goal row
    python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --pack-episodes off
                                                        # the same, one learner row per turn (the A/B of episode rows)
    python bench/llm_policy_craftax.py --quick          # CPU smoke run (tiny shape, Craftax-Classic, 4 envs)
    python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --prefill-compile
                                                        # the engine's packed prefill compiled (rows: prefill_compile)

Each configuration builds the policy exactly as `thinkcraft train llm-policy` does (`loop.build_policy`) and
runs its synchronous learner steps (`loop.train_step`: rollout = generation + env, store off, train with the
Learner as it is). The first step pays the compiles (Craftax, the decode step's CUDA graphs) and is left out;
the numbers are over the following steps:

    decisions_per_s           turns / (rollout + train) - end to end, synchronous
    rollout_decisions_per_s   turns / rollout wall time (`timing/rollout`: generate, env and the host's work
                              between them, the turn records included; rows before 2026-12-02's third session
                              divided by generate + env alone, which left ~0.06 s a step of host work out)
    *_last                    the same for the last step alone (run --steps 4 or more for a steady one)
    generate_tok_per_s        generated tokens / generate time (prefill, decode and prompt building)
    generate_share            generate time / step time
    prefill_tokens_saved_frac prompt tokens whose KV the engine already held (turn reuse + shared prefix;
                              turn_reuse_saved_frac: by turn reuse alone)
    peak_learner_gb           peak allocated GPU memory during the learner update (the engine's KV cache,
                              resident, included: kv_cache_gb says how much of it that is)
    learner_tokens_per_s      real (unpadded) tokens the learner trained on / train time (advantages, rows
                              and the update). The learner alone, with the real vocabulary: bench/learner_memory.py
    learner_tokens            real tokens the learner trains on per step (median): with --pack-episodes on (the
                              default) an episode whose turns extend each other is one row, its last turn
    learner_tokens_saved_frac 1 - learner_tokens / the tokens of one row per turn (each repeating the history)

Writes bench/results/llm_policy_craftax.json (rows merged by configuration). Random weights never emit a
parsable action: this measures speed only (every action is a no-op; episodes run to --max-turns).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import (card, decode_graphs_column, decode_means, host_profile, print_table, today, torch_profile,  # noqa: E402
                    write_records)

COLS = ["model_shape", "num_envs", "max_new_tokens", "thinking_budget", "decisions_per_s", "rollout_decisions_per_s",
        "decisions_per_s_last", "generate_tok_per_s", "generate_share", "prefill_tokens_saved_frac", "peak_learner_gb", "learner_tokens_per_s",
        "learner_tokens", "learner_tokens_saved_frac", "kv_cache_gb", "s_per_step"]


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen3-4b"])
    p.add_argument("--num-envs", nargs="+", type=int, default=[64, 256])
    p.add_argument("--thinking-budgets", nargs="+", type=int, default=[0, 256], help="0 = no thinking")
    p.add_argument("--max-new-tokens", type=int, default=32, help="action tokens (after the thought, if any)")
    p.add_argument("--max-turns", type=int, default=8, help="decisions per episode")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="learner steps; the first is warm-up")
    p.add_argument("--env", default="craftax", choices=["craftax", "craftax-classic"])
    p.add_argument("--finetune", default="lora", choices=["lora", "full"])
    p.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="learner tokens per forward/backward (0 = sized to the device after the first update, as "
                        "`train llm-policy`'s default)")
    p.add_argument("--learner-compile", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the learner's packed forward (LLMPolicyConfig.learner_compile): auto (the "
                        "library's default: on for a CUDA learner with a plain decoder), on (the bare flag), off")
    p.add_argument("--prefill-compile", action="store_true",
                   help="the engine's packed prefill through torch.compile (THINKCRAFT_PREFILL_COMPILE=1)")
    p.add_argument("--micro-batch-size", type=int, default=0, help="learner rows per micro-batch at most (0 = no cap)")
    p.add_argument("--pack-episodes", default="on", choices=["on", "off"],
                   help="train an episode whose turns extend each other as one row (off: one row per turn)")
    p.add_argument("--kv-cache", default="auto", choices=["auto", "static", "dynamic"])
    p.add_argument("--unroll-env-scans", default="auto", choices=["auto", "on", "off"],
                   help="the Craftax text env's inner loops traced unrolled (LLMPolicyConfig.unroll_env_scans; auto = "
                        "on a GPU)")
    p.add_argument("--compile-decode", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--kv-cache-gb", type=float, default=None, help="engine KV budget (default: half the free memory)")
    p.add_argument("--device", default="auto")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shape, Craftax-Classic, 4 envs, 2 turns")
    p.add_argument("--profile-steady", type=float, default=0.0, metavar="SECONDS",
                   help="py-spy this process for SECONDS from the third step on (bench/steady_profile.py): "
                        "per-thread summary in <out>_profile.json")
    p.add_argument("--profile-update", type=int, default=None, metavar="STEP",
                   help="torch.profiler over the learner update of step STEP (-1: the last): the top operators by "
                        "device and host time and the kernel count in <out>_learner_profile-<case>.{txt,json}")
    p.add_argument("--submit-chunk", type=int, default=None, metavar="N",
                   help="episodes whose next prompts are built and submitted before the engine steps again "
                        "(the rollout's SUBMIT_CHUNK; default: the library's)")
    p.add_argument("--variants", nargs="+", default=None, metavar="SPEC",
                   help="settings taken in turns by the steps of one run (one compile, the same machine state, "
                        "interleaved): step 0 takes the first, step k >= 1 the ((k - 1) mod n)-th; each SPEC is "
                        "KEY=VALUE[,KEY=VALUE] with KEY chunk (the rollout's SUBMIT_CHUNK), first (its first chunk's "
                        "length: SUBMIT_FIRST, 0 none), env_chunked (0/1: "
                        "THINKCRAFT_ENV_CHUNKED) or prefill_pad (0/1: THINKCRAFT_PREFILL_PAD), e.g. `--variants "
                        "chunk=256 chunk=128 chunk=128,env_chunked=1`. The row gets `variant_rows`: each setting's rates over its steps after its first (that one may "
                        "capture graphs); --steps must give every setting two steps after step 0")
    p.add_argument("--profile-rollout", type=int, default=None, metavar="STEP",
                   help="torch.profiler over the rollout (generation + env) of step STEP (-1: the last): where the "
                        "decode steps' and prefills' device time goes, in <out>_rollout_profile-<case>.{txt,json}, with the "
                        "device timeline (every kernel's start and length, <case>_kernels.tsv.gz, and the idle gaps "
                        "by size in the .json); "
                        "that step is left out of the rates, as --profile-update's")
    p.add_argument("--profile-host", type=int, default=None, metavar="STEP",
                   help="cProfile over the rollout of step STEP (-1: the last): the host's functions by their own time "
                        "and by their time with callees, in <out>_host_profile-<case>.txt (where the ~90 ms a turn that the "
                        "device idles at the turns' boundaries goes); that step is left out of the rates")
    p.add_argument("--out", default=None, help="default bench/results/llm_policy_craftax[_quick].json")
    a = p.parse_args(argv)
    if a.submit_chunk is not None and a.submit_chunk < 1:
        p.error(f"--submit-chunk must be >= 1, got {a.submit_chunk}")
    if a.quick:
        a.shapes, a.num_envs, a.thinking_budgets = ["tiny"], [4], [0, 6]
        a.max_new_tokens, a.max_turns, a.group_size, a.steps, a.env = 6, 2, 2, 2, "craftax-classic"
        if a.variants:  # step 0, then two steps of each setting
            a.steps = 1 + 2 * len(a.variants)
        a.micro_batch_tokens, a.device = 256, "cpu"
    if a.variants:
        try:
            a.variant_settings = [parse_variant(v) for v in a.variants]
        except ValueError as e:
            p.error(str(e))
        if a.steps < 1 + 2 * len(a.variants):
            p.error(f"--variants: {len(a.variants)} settings need --steps >= {1 + 2 * len(a.variants)} (step 0, then "
                    f"two steps of each: the first of a setting may capture graphs and is left out), got {a.steps}")
    else:
        a.variant_settings = []
    a.out = a.out or str(ROOT / "bench" / "results" / f"llm_policy_craftax{'_quick' if a.quick else ''}.json")
    return a


def _config(a: argparse.Namespace, shape: str, num_envs: int, budget: int, run_dir: str) -> Any:
    from thinkcraft.train.llm_policy import LLMPolicyConfig

    close = 8  # tokens of the forced "</think>" line, with room to spare
    return LLMPolicyConfig(
        env=a.env, model=f"random:{shape}", run_dir=run_dir, steps=a.steps, prompts_per_step=num_envs // a.group_size,
        group_size=a.group_size, max_new_tokens=a.max_new_tokens + (budget + close if budget else 0),
        thinking_budget=budget or None, max_turns=a.max_turns, history_turns=-1, finetune=a.finetune,
        micro_batch_tokens=a.micro_batch_tokens, micro_batch_size=a.micro_batch_size, kv_cache=a.kv_cache,
        learner_compile={"auto": None, "on": True, "off": False}[a.learner_compile],
        pack_episodes=a.pack_episodes == "on",
        compile_decode={"auto": None, "on": True, "off": False}[a.compile_decode], kv_cache_gb=a.kv_cache_gb,
        device=a.device, store=False, unroll_env_scans=a.unroll_env_scans,
        plot=False, seed=0)


def settled_steps(steady: list[Any]) -> list[Any]:
    """Of the steady steps, those in which no graph was captured (decode or prefill: a new shape's capture, and the
    prefill graphs' checks against the eager forward, cost a step up to ~0.5 s once, 2026-12-02 s53): the rates a long
    run settles at. Empty when every steady step captured."""
    return [r for r in steady if r.get("engine/graph_captures", 0.0) == 0 and r.get("engine/prefill_graph_captures", 0.0) == 0]


def steady_steps(recs: list[Any], *profiled: int | None) -> list[Any]:
    """The steps the rates average: after the first (it compiles), without those whose learner update or
    rollout ran under torch.profiler (2026-11-27, H200: 37.1 s against 10.7-11.2 s, and it was in the means) -
    measured apart, in their own files. With no other step left, the profiled ones; with one step, that step."""
    return [r for i, r in enumerate(recs) if i >= 1 and i not in profiled] or recs[1:] or recs


def env_phases(recs: list[Any], steady: list[Any]) -> dict[str, float]:
    """`env_<phase>_s`: the median over `steady` of each step's own share of the env's cumulative `env_time/<phase>_s`
    counters (the difference with the record before it in `recs`; the first record's are its own)."""
    keys = sorted({k for r in steady for k in r if k.startswith("env_time/") and k.endswith("_s")})
    out = {}
    for k in keys:
        own = []
        for r in steady:
            i = next(j for j, x in enumerate(recs) if x is r)
            own.append(r.get(k, 0.0) - (recs[i - 1].get(k, 0.0) if i else 0.0))
        out["env_" + k[len("env_time/"):]] = round(statistics.median(own), 4)
    return out


VARIANT_KEYS = ("chunk", "first", "env_chunked", "prefill_pad")
"""What `--variants` may set per step: the rollout's SUBMIT_CHUNK and SUBMIT_FIRST (the first chunk's length, 0 none),
THINKCRAFT_ENV_CHUNKED (read by each rollout) and THINKCRAFT_PREFILL_PAD (read by each eager prefill)."""
_VARIANT_ENV = {"env_chunked": "THINKCRAFT_ENV_CHUNKED", "prefill_pad": "THINKCRAFT_PREFILL_PAD"}


def parse_variant(spec: str) -> dict[str, int]:
    """`--variants`' SPEC, `chunk=128,env_chunked=1`, as {key: value}; ValueError naming what is wrong."""
    out: dict[str, int] = {}
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in VARIANT_KEYS:
            raise ValueError(f"--variants: {part!r} in {spec!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(VARIANT_KEYS)}")
        try:
            n = int(value)
        except ValueError:
            n = -1
        if (key == "chunk" and n < 1) or (key == "first" and n < 0) or (key in _VARIANT_ENV and n not in (0, 1)):
            want = {"chunk": ">= 1", "first": ">= 0"}.get(key, "0 or 1")
            raise ValueError(f"--variants: {key} must be {want}, got {value!r}")
        if key in out:
            raise ValueError(f"--variants: {key} given twice in {spec!r}")
        out[key] = n
    return out


def variant_of_step(n_variants: int, step: int) -> int:
    """The setting step `step` takes (`--variants`): the first for step 0 (it compiles), then each in turn."""
    return 0 if step == 0 or n_variants == 0 else (step - 1) % n_variants


@contextlib.contextmanager
def variant_applied(setting: dict[str, int], module: Any) -> Iterator[None]:
    """`setting` in effect for the block (a rollout): SUBMIT_CHUNK and the switches of `_VARIANT_ENV`, each put back
    after."""
    chunk, first = module.SUBMIT_CHUNK, module.SUBMIT_FIRST
    before = {var: os.environ.get(var) for var in _VARIANT_ENV.values()}
    try:
        if "chunk" in setting:
            module.SUBMIT_CHUNK = setting["chunk"]
        if "first" in setting:
            module.SUBMIT_FIRST = setting["first"]
        for key, var in _VARIANT_ENV.items():
            if key in setting:
                os.environ[var] = str(setting[key])
        yield
    finally:
        module.SUBMIT_CHUNK, module.SUBMIT_FIRST = chunk, first
        for var, v in before.items():
            if v is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = v


def variant_rows(recs: list[Any], specs: list[str], num_envs: int, left_out: set[int]) -> list[dict[str, Any]]:
    """Per `--variants` setting: its rates over its steps after step 0 and after its own first step (a setting's
    first rollout may capture graphs of new shapes), leaving out the profiled steps (`left_out`)."""
    med = statistics.median
    out = []
    for j, spec in enumerate(specs):
        mine = [i for i in range(1, len(recs)) if variant_of_step(len(specs), i) == j and i not in left_out][1:]
        rs = [recs[i] for i in mine]
        if not rs:
            out.append({"variant": spec, "steps": []})
            continue
        turns = [r["episode/turns"] * num_envs for r in rs]
        roll = [r.get("timing/rollout", r.get("timing/generate", 0.0) + r.get("timing/env", 0.0)) for r in rs]
        row = {"variant": spec, "steps": mine,
               "rollout_decisions_per_s": round(sum(turns) / sum(roll), 1),
               "decisions_per_s": round(sum(turns) / sum(r["timing/step"] for r in rs), 1),
               "rollout_s": round(med(roll), 3), "rollout_s_by_step": [round(x, 3) for x in roll]}
        for name, key in (("generate_s", "timing/generate"), ("env_s", "timing/env"), ("prompts_s", "timing/prompts"),
                          ("prefill_s", "engine/prefill_s"), ("prefill_calls", "engine/prefill_calls"),
                          ("prefill_graph_replays", "engine/prefill_graph_replays"), ("decode_s", "engine/decode_s"),
                          ("graph_captures", "engine/prefill_graph_captures")):
            row[name] = round(med([r.get(key, 0.0) for r in rs]), 3)
        row["engine_idle_s"] = round(med([r.get("timing/generate", 0.0) - r.get("engine/prefill_s", 0.0)
                                          - r.get("engine/decode_s", 0.0) for r in rs]), 3)
        row.update({k[len("engine/"):]: round(med([r.get(k, 0.0) for r in rs]), 3)
                    for k in sorted({k for r in rs for k in r if k.startswith("engine/dev_")})})
        out.append(row)
    return out


@contextlib.contextmanager
def rollout_patches(submit_chunk: int | None, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
                    ) -> Iterator[int]:
    """For the block (which gets the SUBMIT_CHUNK in effect): the train step's `rollout` (the loop module's name
    for it) replaced by `wrap(rollout)`, and the rollout module's SUBMIT_CHUNK set to `submit_chunk` (None:
    kept); both undone after, whatever happens (main() goes on to the next case after an error). The modules by
    their full names: the package's `rollout` attribute is the function of that name, and an attribute set on a
    function fails silently (2026-11-28: a "--submit-chunk 256" GPU run kept 64)."""
    loop = importlib.import_module("thinkcraft.train.llm_policy.loop")
    module = importlib.import_module("thinkcraft.train.llm_policy.rollout")
    plain, chunk = loop.rollout, module.SUBMIT_CHUNK
    loop.rollout, module.SUBMIT_CHUNK = wrap(plain), submit_chunk or chunk
    try:
        yield module.SUBMIT_CHUNK
    finally:
        loop.rollout, module.SUBMIT_CHUNK = plain, chunk


def _run_steps(a: argparse.Namespace, cfg: Any, policy: Any, recs: list[Any], prof: Any, shape: str, num_envs: int,
               budget: int) -> None:
    """The measured train steps (records appended to `recs`, each step's line printed)."""
    from thinkcraft.train.llm_policy.loop import Carry, train_step
    from thinkcraft.utils.timing import PhaseTimer

    carry, timer = Carry(), PhaseTimer()
    with prof:
        for step in range(a.steps):
            timer.reset()
            t0 = time.perf_counter()
            rec, carry = train_step(cfg, policy, step, carry, None, timer)
            rec["wall_s"] = time.perf_counter() - t0
            recs.append(rec)
            print(f"  {shape} envs={num_envs} budget={budget} step {step}: {rec['timing/step']:.2f} s "
                  f"(rollout {rec.get('timing/rollout', 0):.2f}: generate {rec.get('timing/generate', 0):.2f}, env "
                  f"{rec.get('timing/env', 0):.2f}, records {rec.get('timing/records', 0):.3f}; "
                  f"train {rec.get('timing/train', 0):.2f} in micro-batches of {rec.get('learner/micro_batch_tokens', 0):.0f} "
                  f"tokens; decode step {rec.get('engine/decode_step_ms', 0):.2f} ms, "
                  f"{rec.get('engine/decode_wait_ms', 0):.2f} of it waiting for the device, "
                  f"{rec.get('engine/rows_per_decode_step', 0):.0f} rows; prefill {rec.get('engine/prefill_s', 0):.2f} s in "
                  f"{rec.get('engine/prefill_calls', 0):.0f} calls, {rec.get('engine/prefill_tokens', 0):.0f} tokens, "
                  f"{rec.get('engine/prefill_graph_replays', 0):.0f} replayed from graphs "
                  f"({rec.get('engine/prefill_graph_captures', 0):.0f} captured in "
                  f"{rec.get('engine/prefill_graph_capture_s', 0):.1f} s); decode graphs captured {rec.get('engine/graph_captures', 0):.0f} in "
                  f"{rec.get('engine/graph_capture_s', 0):.1f} s; garbage collector {rec.get('host/gc_s', 0):.3f} s, "
                  f"{rec.get('host/gc_full', 0):.0f} full)",
                  flush=True)
            if "engine/dev_decode_ms" in rec:  # THINKCRAFT_DEVICE_TIMING=1
                print("    device: " + ", ".join(f"{k[len('engine/dev_'):]} {v:.3f}" for k, v in sorted(rec.items())
                                                 if k.startswith("engine/dev_")), flush=True)


def measure(a: argparse.Namespace, shape: str, num_envs: int, budget: int) -> dict[str, Any]:
    import torch

    from thinkcraft.train.llm_policy.loop import build_policy

    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(a, shape, num_envs, budget, tmp)
        policy = build_policy(cfg)
        cuda = policy.learner.device.type == "cuda"
        peaks: list[float] = []
        update = policy.learner.update

        profile_at = None if a.profile_update is None else a.profile_update % a.steps
        rollout_at = None if a.profile_rollout is None else a.profile_rollout % a.steps
        host_at = None if a.profile_host is None else a.profile_host % a.steps

        def measured_update(*args: Any, **kw: Any) -> Any:  # the peak of the learner phase alone
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            if len(recs) == profile_at:
                label = f"{shape}-{num_envs}envs-budget{budget}-step{len(recs)}"
                out, _ = torch_profile(lambda: update(*args, **kw), cuda,
                                       Path(a.out).with_name(f"{Path(a.out).stem}_learner_profile-{label}"), label)
            else:
                out = update(*args, **kw)
            if cuda:
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() / 2**30)
            return out

        policy.learner.update = measured_update

        settings = a.variant_settings
        rollout_module = importlib.import_module("thinkcraft.train.llm_policy.rollout")

        def profiled_at_its_step(plain_rollout: Callable[..., Any]) -> Callable[..., Any]:
            def measured_rollout(*args: Any, **kw: Any) -> Any:
                if not settings:
                    return profiled_rollout(*args, **kw)
                with variant_applied(settings[variant_of_step(len(settings), len(recs))], rollout_module):
                    return profiled_rollout(*args, **kw)

            def profiled_rollout(*args: Any, **kw: Any) -> Any:
                label = f"{shape}-{num_envs}envs-budget{budget}-step{len(recs)}"
                if len(recs) == host_at:
                    return host_profile(lambda: plain_rollout(*args, **kw),
                                        Path(a.out).with_name(f"{Path(a.out).stem}_host_profile-{label}.txt"), label)
                if len(recs) != rollout_at:
                    return plain_rollout(*args, **kw)
                out, _ = torch_profile(lambda: plain_rollout(*args, **kw), cuda,
                                       Path(a.out).with_name(f"{Path(a.out).stem}_rollout_profile-{label}"), label,
                                       timeline=True)
                return out

            return measured_rollout

        recs: list[Any] = []
        prof: Any = contextlib.nullcontext()
        if a.profile_steady > 0:  # after steps 0 (compiles) and 1 (the first after a weight update)
            from steady_profile import SteadyProfile

            out = Path(a.out)
            prof = SteadyProfile(lambda: len(recs) >= 2, out.with_name(out.stem + "_profile.json"),
                                 f"{shape}-{num_envs}envs-budget{budget}", seconds=a.profile_steady)
        with rollout_patches(a.submit_chunk, profiled_at_its_step) as submit_chunk:
            _run_steps(a, cfg, policy, recs, prof, shape, num_envs, budget)
        kv = policy.engine.decode_metrics()
        text_env = getattr(policy.env, "env", policy.env)
        env_unrolled = getattr(text_env, "unrolled", None)
        kv_gb = kv["kv_cache_gb"]
        engine_cfg = (policy.engine.kv_cache, policy.engine.compile_decode)
        from thinkcraft.llm.hf import fused_norm, lora_fast
        from thinkcraft.llm.hf.split_decode import prefix_rows as split_decode_rows
        from thinkcraft.utils.errors import env_switch
        from thinkcraft.utils.gc_clock import GC_CLOCK
        from thinkcraft.llm.hf.batcher import decode_ahead

        # llm/hf/lora_fast.py's layers (0: PEFT's forward); "merged": with merged weights (THINKCRAFT_LORA_MERGE, the
        # CUDA default since 2026-12-08; 0 also when they did not fit); "train": the learner's cast-free gradient path
        # (THINKCRAFT_LORA_FAST_TRAIN)
        lora_counts = lora_fast.counts(getattr(policy.engine, "_lora_fast", None) or [])
        fused_norms = fused_norm.installed(policy.learner.model)  # llm/hf/fused_norm.py (THINKCRAFT_FUSED_RMSNORM)
        # the decode step's slot attention: FlashAttention in place (llm/hf/slots.py `decode_kernel`,
        # THINKCRAFT_FLASH_DECODE) or the matmul path over the whole width; the engine's own counter
        flash_decode = bool(kv.get("flash_decode", 0.0))
        # the prefill's attention: keys read in place (slots.py `prefill_inplace_kernel`, THINKCRAFT_FLASH_PREFILL)
        # or gathered per row
        flash_prefill = bool(kv.get("flash_prefill", 0.0))
        # the sampler: the one-pass kernel (llm/hf/fused_sampler.py, THINKCRAFT_FUSED_SAMPLER) or torch's
        fused_sampler = bool(kv.get("fused_sampler", 0.0))
        # the decode attention split-KV, own columns and prefix in one launch (llm/hf/split_decode.py,
        # THINKCRAFT_SPLIT_DECODE), in place of FlashAttention's calls
        split_decode = bool(kv.get("split_decode", 0.0))
        # q/k/v and gate/up groups run as one GEMM each (llm/hf/fused_proj.py, THINKCRAFT_FUSED_PROJ)
        fused_proj_groups = int(kv.get("fused_proj_groups", 0.0))
        # of them, the LoRA groups whose adapters' A rides in the base GEMM (fused_proj.py, THINKCRAFT_FOLD_LORA_A)
        fused_proj_folded = int(kv.get("fused_proj_folded", 0.0))
        # the MLPs' silu(gate) * up as one kernel, decode and prefill (llm/hf/fused_mlp.py, THINKCRAFT_FUSED_MLP)
        fused_mlp = bool(kv.get("fused_mlp", 0.0))
        # of them, a LoRA gate/up group's low-rank add inside the kernel (fused_mlp.py, THINKCRAFT_FUSED_MLP_LORA)
        fused_mlp_lora = bool(kv.get("fused_mlp_lora", 0.0))
        # q's and k's rotary embedding as one kernel each in the prefill (llm/hf/fused_rope.py, THINKCRAFT_FUSED_ROPE)
        fused_rope = bool(kv.get("fused_rope", 0.0))
        del policy
    GC_CLOCK.unfreeze()  # the loop froze the heap after step 0: this configuration's model collectable again
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    steady = steady_steps(recs, profile_at, rollout_at, host_at)
    turns = [r["episode/turns"] * num_envs for r in steady]
    step_s = [r["timing/step"] for r in steady]
    gen_s = [r.get("timing/generate", 0.0) for r in steady]
    env_s = [r.get("timing/env", 0.0) for r in steady]
    # the rollout's wall time (a record without it: generate + env, as rows before 2026-12-02 were computed)
    roll_s = [r.get("timing/rollout", g + e) for r, g, e in zip(steady, gen_s, env_s)]
    tokens = [r["completion/mean_tokens"] * n for r, n in zip(steady, turns)]
    settled = settled_steps(steady)
    s_turns = sum(r["episode/turns"] * num_envs for r in settled)
    med = statistics.median
    return {
        "model_shape": shape, "num_envs": num_envs, "max_new_tokens": a.max_new_tokens, "thinking_budget": budget,
        "decisions_per_s": round(sum(turns) / sum(step_s), 1),
        "rollout_decisions_per_s": round(sum(turns) / sum(roll_s), 1),
        # the last step alone: on a GPU the step after the first weight update has recompiled the decode
        # step (H100, 2026-11-26: 118 s vs 20.7 s), which the averages above include with --steps 3
        "decisions_per_s_last": round(turns[-1] / step_s[-1], 1),
        "rollout_decisions_per_s_last": round(turns[-1] / roll_s[-1], 1),
        # over the steady steps that captured no graph (`settled_steps`; None: none did) - what a long run settles at
        "decisions_per_s_settled": round(s_turns / sum(r["timing/step"] for r in settled), 1) if settled else None,
        "rollout_decisions_per_s_settled": (round(s_turns / sum(r.get("timing/rollout", 0.0) for r in settled), 1)
                                            if settled and all("timing/rollout" in r for r in settled) else None),
        "steps_settled": len(settled),
        # per measured step (the first included): the rollout's wall time and the graphs captured in it
        "rollout_s_by_step": [round(r.get("timing/rollout", 0.0), 3) for r in recs],
        "graph_captures_by_step": [int(r.get("engine/graph_captures", 0.0) + r.get("engine/prefill_graph_captures", 0.0))
                                   for r in recs],
        "generate_tok_per_s": round(sum(tokens) / max(sum(gen_s), 1e-9), 1),
        "generate_share": round(sum(gen_s) / sum(step_s), 3),
        "prefill_tokens_saved_frac": round(med([r.get("kv/prefill_saved_frac", 0.0) for r in steady]), 3),
        "turn_reuse_saved_frac": round(med([r.get("kv/turn_reuse_saved_frac", 0.0) for r in steady]), 3),
        "peak_learner_gb": round(max(peaks), 2) if peaks else None,
        "kv_cache_gb": round(kv_gb, 2),
        "s_per_step": round(med(step_s), 3), "env_s": round(med(env_s), 3), "generate_s": round(med(gen_s), 3),
        "rollout_s": round(med(roll_s), 3),
        # the rollout's host work outside generate and env (the records' chunks are timed as `timing/records`)
        "rollout_host_s": round(med([r - g - e for r, g, e in zip(roll_s, gen_s, env_s)]), 3),
        "records_s": round(med([r.get("timing/records", 0.0) for r in steady]), 3),
        # of generate, the next prompts' host work (render the chat pieces, tokenize: `ChatPrompts.next`)
        "prompts_s": round(med([r.get("timing/prompts", 0.0) for r in steady]), 3),
        # the text env's host time a rollout by phase of its steps (the env's `env_time/*_s`, each step's own: parse
        # the actions' texts, dispatch the compiled step, fetch - the wait for the device and the copy back -, render
        # the texts; `env_s` holds these and the rollout's reset)
        **env_phases(recs, steady),
        "train_s": round(med([r.get("timing/train", 0.0) for r in steady]), 3),
        "learner_tokens_per_s": round(sum(r.get("learner/tokens", 0.0) for r in steady)
                                      / max(sum(r.get("timing/train", 0.0) for r in steady), 1e-9), 1),
        "learner_packed": bool(steady[-1].get("learner/packed", 0.0)),
        # the generate phase split (engine counters; one engine): prefill forwards, decode loop, the rest idle
        "prefill_s": round(med([r.get("engine/prefill_s", 0.0) for r in steady]), 3),
        "prefill_calls": round(med([r.get("engine/prefill_calls", 0.0) for r in steady])),
        "prefill_tokens": round(med([r.get("engine/prefill_tokens", 0.0) for r in steady])),
        # of the prefill calls, those replayed from CUDA graphs (llm/hf/prefill_graphs.py, THINKCRAFT_PREFILL_GRAPHS),
        # and the graphs captured in the steady steps (0 once the rollout's buckets are all seen)
        "prefill_graph_replays": round(med([r.get("engine/prefill_graph_replays", 0.0) for r in steady])),
        "prefill_graph_captures_steady": sum(r.get("engine/prefill_graph_captures", 0.0) for r in steady),
        "prefill_graph_failed": bool(steady[-1].get("engine/prefill_graph_failed", 0.0)),
        "decode_s": round(med([r.get("engine/decode_s", 0.0) for r in steady]), 3),
        # decode graphs compiled + captured in the steady steps (a new width there costs its compile) and seconds
        "graph_captures_steady": sum(r.get("engine/graph_captures", 0.0) for r in steady),
        "graph_capture_s_steady": round(sum(r.get("engine/graph_capture_s", 0.0) for r in steady), 1),
        # Python's garbage collector inside the step (utils/gc_clock.py)
        "host_gc_s": round(med([r.get("host/gc_s", 0.0) for r in steady]), 3),
        "host_gc_full": round(med([r.get("host/gc_full", 0.0) for r in steady])),
        "engine_idle_s": round(med([r.get("timing/generate", 0.0) - r.get("engine/prefill_s", 0.0)
                                    - r.get("engine/decode_s", 0.0) for r in steady]), 3),
        "learner_tokens": round(med([r.get("learner/tokens", 0.0) for r in steady])),
        # tokens through the model: the system prompt shared by a micro-batch's rows computed once
        "learner_tokens_computed": round(med([r.get("learner/tokens_computed", r.get("learner/tokens", 0.0))
                                              for r in steady])),
        "learner_tokens_saved_frac": round(med([r.get("learner/tokens_saved_frac", 0.0) for r in steady]), 3),
        "learner_episode_rows": round(med([r.get("learner/episode_rows", 0.0) for r in steady])),
        "learner_turn_rows": round(med([r.get("learner/turn_rows", 0.0) for r in steady])),
        "pack_episodes": a.pack_episodes == "on",
        "decisions_per_step": round(med(turns), 1), "mean_action_tokens": round(med(
            [r["completion/mean_tokens"] for r in steady]), 1),
        "thinking_tokens_mean": round(med([r.get("thinking/tokens_mean", 0.0) for r in steady]), 1),
        "template_fallbacks": sum(r.get("kv/template_fallbacks", 0.0) for r in steady),
        # THINKCRAFT_DEVICE_TIMING=1 (llm/hf/device_timing.py): the device's time per phase and idle between phases,
        # ms per phase (`dev_decode_ms`: one decode iteration) or per gap, and seconds a step (`dev_*_s`)
        **{k[len("engine/"):]: round(med([r.get(k, 0.0) for r in steady]), 3)
           for k in sorted({k for r in steady for k in r if k.startswith("engine/dev_")})},
        # the env's inner loops traced unrolled (envs/unroll.py): the setting resolved
        "env_unrolled": env_unrolled,
        # the env's step: state donated (THINKCRAFT_ENV_DONATE), actions fed as numpy (THINKCRAFT_ENV_NUMPY_INPUTS),
        # its calls compiled with XLA command buffers (THINKCRAFT_ENV_CMDBUF)
        "env_donates": getattr(text_env, "donates_state", None),
        "env_numpy_inputs": getattr(text_env, "numpy_inputs", None),
        "env_command_buffers": getattr(text_env, "command_buffers", None),
        "kv_evictions": kv["evictions"], "decode_steps": kv["decode_steps"],
        # decode iterations not launched: every row's last token already in flight (iteration.py `_ends_in_flight`)
        "launches_skipped": kv.get("launches_skipped", 0.0),
        # eager prefills over a bucket's token count (THINKCRAFT_PREFILL_PAD, prefill_graphs.py `padded_forward`)
        "prefill_pad": env_switch("THINKCRAFT_PREFILL_PAD"), "prefill_pad_tokens": kv.get("prefill_pad_tokens", 0.0),
        "skip_ended_launch": env_switch("THINKCRAFT_SKIP_ENDED_LAUNCH", default=True), "slots": kv["slots"],
        "slot_tokens": kv["slot_tokens"], "kv_cache": engine_cfg[0], "compiled": engine_cfg[1],
        **{k: round(v, 3) for k, v in decode_means(steady).items()},
        "decode_graphs": decode_graphs_column(engine_cfg[0]),
        "first_step_s": round(recs[0]["timing/step"], 2), "steps_measured": len(steady), "profiled_step": profile_at,
        "rollout_profiled_step": rollout_at, "host_profiled_step": host_at,
        "submit_chunk": submit_chunk,
        # a boundary's first submit chunk where it is shorter (the rollout's SUBMIT_FIRST; 0: none)
        "submit_first": importlib.import_module("thinkcraft.train.llm_policy.rollout").SUBMIT_FIRST,
        # --variants: the settings the steps took in turns, and each one's rates (`variant_rows`)
        "variants": " ".join(a.variants) if a.variants else None,
        "variant_by_step": [variant_of_step(len(a.variants), i) for i in range(len(recs))] if a.variants else None,
        "variant_rows": variant_rows(recs, a.variants, num_envs, {x for x in (profile_at, rollout_at, host_at)
                                                                  if x is not None}) if a.variants else None,
        # each submit chunk of a boundary its own env call (THINKCRAFT_ENV_CHUNKED, rollout.py `_env_step`)
        "env_chunked": env_switch("THINKCRAFT_ENV_CHUNKED"), "env": a.env, "lora_fast_layers": lora_counts["fast"],
        "lora_merged_layers": lora_counts["merged"], "lora_fast_train_layers": lora_counts["train"],
        # how the merged weights were rounded (lora_fast.merge_rounding; None where nothing is merged)
        "lora_merge_rounding": lora_fast.merge_rounding() if lora_counts["merged"] else None,
        "fused_rmsnorms": fused_norms, "flash_decode": flash_decode, "flash_prefill": flash_prefill,
        "fused_sampler": fused_sampler, "split_decode": split_decode,
        # the split decode's shared prefix read for blocks of this many rows (THINKCRAFT_SPLIT_PREFIX_ROWS; 0: a row a
        # program) and the compiled LoRA groups' low-rank add as the in-place op (THINKCRAFT_LORA_ADD_OP)
        "split_prefix_rows": split_decode_rows() if split_decode else None,
        # the split decode's partials written for the GQA group's heads only (split_decode.py,
        # THINKCRAFT_SPLIT_PARTIAL_ROWS), or its whole padded tile
        "split_partial_rows": env_switch("THINKCRAFT_SPLIT_PARTIAL_ROWS", default=True) if split_decode else None,
        # and its shared prefix's programs on a side stream beside the own chunks (THINKCRAFT_SPLIT_PREFIX_STREAM)
        "split_prefix_stream": env_switch("THINKCRAFT_SPLIT_PREFIX_STREAM", default=True) if split_decode else None,
        "lora_add_op": env_switch("THINKCRAFT_LORA_ADD_OP", default=True) and fused_proj_groups > 0,
        # the decode step's GEMMs autotuned by inductor (THINKCRAFT_DECODE_AUTOTUNE, opt-in)
        "decode_autotune": env_switch("THINKCRAFT_DECODE_AUTOTUNE"), "fused_mlp": fused_mlp, "fused_rope": fused_rope,
        "fused_mlp_lora": fused_mlp_lora,
        # and inside the compiled decode step as one op (fused_mlp.py `_compiled_hidden`, THINKCRAFT_FUSED_MLP_LORA_COMPILED)
        "fused_mlp_lora_compiled": fused_mlp_lora and env_switch("THINKCRAFT_FUSED_MLP_LORA_COMPILED", default=True),
        # the forwards the two kernels take: 0 every size (llm/hf/triton_device.py, THINKCRAFT_FUSED_TOKENS_MAX)
        "fused_tokens_max": _fused_tokens_max(),
        # the heap frozen after the first step (utils/gc_clock.py, THINKCRAFT_GC_FREEZE)
        "gc_freeze": env_switch("THINKCRAFT_GC_FREEZE", default=True),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "device_timing": env_switch("THINKCRAFT_DEVICE_TIMING", default=False),
        # the packed prefill from CUDA graphs where it may (llm/hf/prefill_graphs.py): the switch
        "prefill_graphs": env_switch("THINKCRAFT_PREFILL_GRAPHS", default=True),
        "fused_proj_groups": fused_proj_groups, "fused_proj_folded": fused_proj_folded,
        # later turns' prompts built around the observation (train/llm_policy/rollout.py ChatPrompts)
        "fast_prompts": os.environ.get("THINKCRAFT_FAST_PROMPTS", "1").strip() != "0",
        # decode iterations launched before the host reads a record (THINKCRAFT_DECODE_AHEAD)
        "decode_ahead": decode_ahead(),
        "max_turns": a.max_turns, "finetune": a.finetune, "card": card(), "date": today(), "quick": a.quick,
        "micro_batch_tokens": a.micro_batch_tokens,
        # whether the learner's forward ran compiled (the flag resolved; None = eager, as rows were keyed before the
        # default compiled it)
        "learner_compile": bool(steady[-1].get("learner/compiled", 0.0)) or None,
        "learner_compile_flag": a.learner_compile,
        "prefill_compile": os.environ.get("THINKCRAFT_PREFILL_COMPILE") == "1" or None,
        # the budget the steady steps ran with (0 above: measured after the first update) and out-of-memory redos
        "micro_batch_tokens_used": int(steady[-1].get("learner/micro_batch_tokens", a.micro_batch_tokens)),
        "learner_micro_batches": round(med([r.get("learner/micro_batches", 0.0) for r in steady]), 1),
        "learner_oom_retries": int(steady[-1].get("learner/oom_retries", 0)),
    }


def _fused_tokens_max() -> int:
    from thinkcraft.llm.hf import triton_device

    return int(triton_device.FUSED_TOKENS_MAX)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    from thinkcraft.utils.jaxcache import configure_process_cache

    # the persistent JAX cache, as `thinkcraft train llm-policy` has it (cli.main): the Craftax text env's
    # programs compiled 40-48 s in step 0 of every run on an H200 machine (2026-11-29, s41 logs), the
    # second run of a call included
    configure_process_cache()
    if a.prefill_compile:
        os.environ["THINKCRAFT_PREFILL_COMPILE"] = "1"
    rows = []
    for shape in a.shapes:
        for n in a.num_envs:
            for budget in a.thinking_budgets:
                try:
                    rows.append(measure(a, shape, n, budget))
                except Exception as e:  # noqa: BLE001 - one configuration failing (OOM) must not lose the others
                    traceback.print_exc()
                    rows.append({"model_shape": shape, "num_envs": n, "max_new_tokens": a.max_new_tokens,
                                 "thinking_budget": budget, "pack_episodes": a.pack_episodes == "on", "error": f"{type(e).__name__}: {e}"[:400], "card": card(),
                                 "date": today()})
                write_records(a.out, rows, merge_keys=("model_shape", "num_envs", "max_new_tokens", "thinking_budget",
                                                       "pack_episodes", "card", "decode_graphs", "micro_batch_tokens",
                                                       "learner_compile", "prefill_compile", "kv_cache", "submit_chunk",
                                                       "submit_first", "variants", "lora_merge_rounding",
                                                       "lora_fast_layers", "lora_merged_layers",
                                                       "lora_fast_train_layers", "fused_rmsnorms", "flash_decode",
                                                       "flash_prefill", "fused_proj_groups", "fused_proj_folded",
                                                       "fast_prompts", "fused_sampler", "split_decode", "decode_ahead",
                                                       "split_prefix_rows", "split_partial_rows", "split_prefix_stream", "lora_add_op", "decode_autotune",
                                                       "fused_mlp", "fused_mlp_lora", "fused_mlp_lora_compiled", "skip_ended_launch", "prefill_graphs", "fused_rope", "fused_tokens_max", "gc_freeze",
                                                       "xla_flags", "device_timing", "env_donates",
                                                       "env_numpy_inputs", "env_command_buffers", "env_chunked", "prefill_pad"))
    print_table(rows, COLS)
    for r in rows:
        for v in r.get("variant_rows") or []:
            print(f"  variant {v['variant']}: steps {v['steps']}: rollout {v.get('rollout_decisions_per_s', '-')} "
                  f"decisions/s ({v.get('rollout_s', '-')} s median; prefill {v.get('prefill_s', '-')} s in "
                  f"{v.get('prefill_calls', '-')} calls, {v.get('prefill_graph_replays', '-')} replayed; engine idle "
                  f"{v.get('engine_idle_s', '-')} s)")
    print(f"wrote {a.out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
