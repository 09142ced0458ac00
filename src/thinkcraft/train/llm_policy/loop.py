"""The synchronous llm-policy step loop (the phases are in the package docstring), inside the training shell
it shares with `train ppo` (train/session.py: run directory, resume, metrics, verified checkpoints,
Ctrl-C/SIGTERM, progress, curve). Things are built in order and passed: no holder dict, no lazy engine."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from thinkcraft.pools.contract import Trajectory
from thinkcraft.train.checkpoint import TORCH_CODEC
from thinkcraft.train.llm_policy.config import SHAPE_FIELDS, LLMPolicyConfig
from thinkcraft.train.llm_policy.learner import (
    Learner, build_rows, checkpoint_state, restore_state, row_scores_and_groups,
)
from thinkcraft.train.llm_policy.model import _device, check_engine_for_algo, load_policy, make_engine, make_judge
from thinkcraft.train.llm_policy.rollout import (
    _prompt_corpus, _seed_of, episode_record, make_env_and_reward, rollout,
)
from thinkcraft.utils.errors import ConfigError
from thinkcraft.utils.gc_clock import GC_CLOCK

PLOT_KEYS = ("reward/mean", "reward/correct_rate", "format/invalid_rate", "completion/mean_tokens",
             "perf/samples_per_s")


class Policy(NamedTuple):
    """What one step uses, built once in order by `build_policy`."""

    env: Any
    tokenizer: Any
    engine: Any  # samples from the learner's own weights (shared parameters, no copy)
    learner: Learner
    sampling: Any  # llm.protocol.SamplingParams


class Carry(NamedTuple):
    """What the loop carries from step to step besides the weights (checkpointed with them)."""

    baseline: float | None = None  # REINFORCE's running reward baseline
    v_star: dict[int, float] | None = None  # A*-PO: V*(x) per problem seed of the pool


def run(cfg: LLMPolicyConfig) -> dict[str, Any]:
    if _run_mode(cfg) == "async":  # rollout, reward and training pools at once (async_loop.py)
        from thinkcraft.train.llm_policy.async_loop import run_async

        return run_async(cfg)
    from thinkcraft.train.session import TrainSession
    from thinkcraft.utils.progress import console

    session = TrainSession(cfg, "llm-policy", shape_fields=SHAPE_FIELDS, defaults=LLMPolicyConfig(),
                           total_steps=lambda c: c.steps, title=lambda c: f"llm-policy {c.algo} on {c.env}",
                           plot_keys=PLOT_KEYS, codec=TORCH_CODEC, x_label="learner steps", update_word="step")
    cfg = session.cfg
    with session:
        # 1. env, policy, engine, learner (the judge after the policy it may reuse)
        policy = build_policy(cfg)
        # 2. resume: weights, optimizer, RNG states, baseline, V* (verified by the session)
        step, carry = 0, Carry()
        if session.resuming:
            step, extra = restore_state(policy.learner, session.restore())
            carry = Carry(extra.get("baseline"), extra.get("v_star"))
        session.save_config()
        writer = _open_store(cfg, session.run_dir, step)
        try:
            if cfg.algo == "apo" and carry.v_star is None:
                carry = carry._replace(v_star=apo_offline(cfg, policy, session.timer))
            session.start(step)
            # 3. steps: rollout -> store -> train -> log -> checkpoint
            while session.running(step, cfg.steps):
                session.timer.reset()
                rec, carry = train_step(cfg, policy, step, carry, writer, session.timer)
                step += 1
                session.log(step, step, rec, reward=rec["reward/mean"], invalid=rec["format/invalid_rate"],
                            s_per_step=rec["timing/step"], samples_s=rec["perf/samples_per_s"])
                _maybe_checkpoint(session, policy.learner, writer, step, carry, force=False)
            _maybe_checkpoint(session, policy.learner, writer, step, carry, force=True)
        finally:
            if writer is not None:
                writer.close()
            # the frozen heap back under the collector: a later run in this process can free this one's cycles, and
            # the interpreter's last collection reaches them (frozen, native objects were reported leaked at exit)
            GC_CLOCK.unfreeze()
        s = session.summary
        correct = f"; correct {100 * s['reward/correct_rate']:.0f}%" if "reward/correct_rate" in s else ""
        console.print(f"done: {step:,}/{cfg.steps:,} steps; reward {s.get('reward/mean', float('nan')):.3f}{correct}; "
                      f"invalid {100 * s.get('format/invalid_rate', 0):.0f}%; "
                      f"samples/s {s.get('perf/samples_per_s', 0):.2f}; run dir {session.run_dir}", soft_wrap=True)
    return session.summary


def _run_mode(cfg: LLMPolicyConfig) -> str:
    """sync or async; on --resume the saved run's mode unless the command line names another (the session's
    merge rule, checkpoint.check_resume_compatible: `--resume --run-dir D` continues an async run as async)."""
    if not cfg.resume or cfg.mode != LLMPolicyConfig.mode:
        return cfg.mode
    from thinkcraft.train.checkpoint import load_config_dict

    run_dir = Path(cfg.run_dir) if cfg.run_dir else Path(cfg.runs_dir) / (cfg.run_name or "")
    try:
        return str(load_config_dict(run_dir).get("mode", cfg.mode))
    except Exception:  # noqa: BLE001 - no readable run there: the session says so, in its words
        return cfg.mode


def build_policy(cfg: LLMPolicyConfig) -> Policy:
    import torch

    from thinkcraft.llm.protocol import SamplingParams

    device = _device(cfg.device)
    for d in (x.strip() for x in cfg.rollout_devices.split(",") if x.strip() and cfg.pool_backend == "local"):
        _device(d, flag="rollout_devices")  # a GPU this machine lacks: said now, not after the model has loaded
    autocast = torch.bfloat16 if (device.type == "cuda" and cfg.bf16) else None
    base_dtype = torch.bfloat16 if (autocast is not None and cfg.finetune == "lora") else torch.float32
    _seed_everything(cfg.seed)
    env = make_env_and_reward(cfg)
    corpus = _prompt_corpus(cfg, env) if cfg.model_spec.scheme == "random" else []
    model, tok = load_policy(cfg, corpus, device, base_dtype)
    if cfg.thinking_budget is not None and not {"<think>", "</think>"} <= set(tok.get_vocab()):
        raise ConfigError("thinking_budget", f"{cfg.model} has no <think>/</think> tokens; drop --thinking-budget")
    engine = make_engine(model, tok, cfg)
    check_engine_for_algo(engine.capabilities, cfg.algo)
    if cfg.reward == "judge":  # the judge may be the policy itself (adapter off): the env is rebuilt with it
        env = make_env_and_reward(cfg, judge=make_judge(cfg, model, tok, engine))
    learner = Learner(cfg, model, tok, device, autocast)
    sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                              logprobs=True, thinking_budget=cfg.thinking_budget)
    # the sampling stream starts at the seed whatever the building drew: the first model built in a process
    # draws more from torch's RNG than later ones, and two identical runs in one process must agree
    _seed_everything(cfg.seed)
    return Policy(env, tok, engine, learner, sampling)


def _seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def apo_offline(cfg: LLMPolicyConfig, p: Policy, timer: Any) -> dict[int, float]:
    """A*-PO's offline phase: V*(x) from N reference samples of each prompt in the pool (π_ref = the
    initial policy)."""
    import torch

    from thinkcraft.rl.llm_losses import apo_value
    from thinkcraft.utils.progress import console

    with timer.phase("apo_offline"):
        pool = [_seed_of(cfg, 0, i) for i in range(cfg.apo_pool_size)]
        eps = rollout(p.env, p.engine, p.tokenizer, pool, cfg.apo_ref_samples, p.sampling, cfg.history_turns,
                      gen_context=p.learner.autocast)
        r = torch.tensor([e.total_reward for e in eps], dtype=torch.float64).view(len(pool), cfg.apo_ref_samples)
        v = apo_value(r, cfg.apo_beta1)
    console.print(f"A*-PO: V* from {cfg.apo_ref_samples} samples x {len(pool)} prompts: mean {float(v.mean()):.3f} "
                  f"(mean reward {float(r.mean()):.3f}) in {timer.seconds('apo_offline'):.1f}s", soft_wrap=True)
    return {int(s): float(x) for s, x in zip(pool, v)}


def _step_seeds(cfg: LLMPolicyConfig, step: int, v_star: dict[int, float] | None) -> list[int]:
    if cfg.algo == "apo":
        rng = random.Random(cfg.seed * 1_000_003 + step)  # per step: a resumed run draws the same
        pool = sorted(v_star or {})
        return [pool[rng.randrange(len(pool))] for _ in range(cfg.prompts_per_step)]
    return [_seed_of(cfg, step + 1, i) for i in range(cfg.prompts_per_step)]


def train_step(cfg: LLMPolicyConfig, p: Policy, step: int, carry: Carry, writer: Any, timer: Any
               ) -> tuple[dict[str, Any], Carry]:
    """One learner step (phases 1-4); returns its metrics and the new carry (with the garbage collector's
    seconds inside it, `host/gc_s`: utils/gc_clock.py)."""
    gc_before = GC_CLOCK.install().snapshot()
    t_step = time.perf_counter()
    # 1-2. rollout (generate + env)
    roll_metrics: dict[str, float] = {}
    episodes = rollout(p.env, p.engine, p.tokenizer, _step_seeds(cfg, step, carry.v_star), cfg.samples_per_prompt,
                       p.sampling, cfg.history_turns, timer, gen_context=p.learner.autocast, metrics=roll_metrics)
    # 3. store
    if writer is not None:
        with timer.phase("store"):
            for e in episodes:
                # stored under the learner step this batch trains (1-based, as metrics.jsonl counts steps);
                # policy_version (the weights that sampled it) is `step`
                writer.add(episode_record(e, cfg.env, step, {"algo": cfg.algo}), learner_step=step + 1)
    # 4. train
    with timer.phase("train"):
        loss_stats, carry = update_on(cfg, p.learner, p.tokenizer, episodes, carry)
    rec = _step_metrics(cfg, p.env, episodes, time.perf_counter() - t_step, timer)
    rec.update({"policy_version": step + 1, **loss_stats, **roll_metrics, **timer.metrics(),
                **GC_CLOCK.metrics_since(gc_before)})
    del episodes  # not frozen with the heap below (freed by reference counting after this step either way)
    rec["host/gc_frozen"] = float(GC_CLOCK.freeze_after_first_step())  # the compiled first step's heap, once
    return rec, carry


def update_on(cfg: LLMPolicyConfig, learner: Learner, tokenizer: Any, episodes: list[Trajectory], carry: Carry
              ) -> tuple[dict[str, float], Carry]:
    """Phase 4 on a batch of episodes (also the async loop's learner): returns-to-go, advantages, the
    learner's rows (episode-packed with --pack-episodes), one learner update. Returns the loss statistics
    (with advantage/abs_mean) and the new carry."""
    import torch

    from thinkcraft.rl.llm_losses import ADVANTAGE_ESTIMATORS, AdvantageInputs, AdvantageOptions

    turns = [t for e in episodes for t in e.turns]
    scores, groups = row_scores_and_groups(episodes, cfg.gamma, cfg.max_turns)
    v_rows = (torch.tensor([carry.v_star[e.seed] for e in episodes for _ in e.turns], dtype=torch.float32)
              if cfg.algo == "apo" else None)
    adv = ADVANTAGE_ESTIMATORS[cfg.algo](
        AdvantageInputs(torch.tensor(scores, dtype=torch.float32), torch.tensor(groups, dtype=torch.long),
                        v_rows, carry.baseline),
        AdvantageOptions(scale_by_std=cfg.scale_adv_by_std, baseline_momentum=cfg.baseline_momentum))
    rows = build_rows(turns, adv.values.tolist(), scores, tokenizer.pad_token_id, learner.device,
                      merge_episodes=cfg.pack_episodes,
                      masks=learner.allowed_tokens(turns))  # json answers: the grammar's allowed sets
    loss_stats = learner.update(rows, v_star=None if v_rows is None else v_rows.to(learner.device))
    loss_stats["advantage/abs_mean"] = float(adv.values.abs().mean())
    return loss_stats, carry._replace(baseline=adv.baseline)


def _step_metrics(cfg: LLMPolicyConfig, env: Any, episodes: list[Trajectory], step_s: float, timer: Any
                  ) -> dict[str, Any]:
    turns = [t for e in episodes for t in e.turns]
    n_gen = sum(len(t.completion_ids) for t in turns)
    rewards = [e.total_reward for e in episodes]
    rec = {
        "reward/mean": float(np.mean(rewards)),
        "reward/std": float(np.std(rewards)),
        "reward/turn_mean": float(np.mean([t.reward for t in turns])),
        "format/invalid_rate": float(np.mean([t.invalid for t in turns])),
        "completion/mean_tokens": n_gen / max(len(turns), 1),
        "completion/truncated_rate": float(np.mean([t.finish_reason == "length" for t in turns])),
        "episode/turns": len(turns) / len(episodes),
        "perf/samples_per_s": len(episodes) / step_s,
        "perf/decisions_per_s": len(turns) / step_s,
        "perf/tokens_per_s": n_gen / step_s,
        "perf/generate_tokens_per_s": n_gen / max(timer.seconds("generate"), 1e-9),
        "timing/step": step_s,
    }
    if cfg.env in ("arith", "gsm8k"):
        rec["reward/correct_rate"] = float(np.mean([t.info.get("correct", False) for t in turns]))
    # the judge's counts, and the text env's host time by phase since its construction (`env_time/*_s`, cumulative:
    # a step's own is the difference with the step before)
    rec.update({k: v for k, v in env.counters().items() if k.startswith(("judge/", "env_time/"))})
    return rec


def _maybe_checkpoint(session: Any, learner: Learner, writer: Any, step: int, carry: Carry, force: bool) -> None:
    if not session.checkpoint_due(step, force):
        return
    if writer is not None:
        writer.flush()  # the store holds every episode up to the checkpoint before it is committed
    session.save_checkpoint(step, step, checkpoint_state(learner, step, carry._asdict()))


def _open_store(cfg: LLMPolicyConfig, run_dir: Path, start_step: int) -> Any:
    """The trajectory store; on resume, the episodes of steps after the checkpoint are dropped (they are
    played again)."""
    if not cfg.store:
        return None
    from thinkcraft.data.writer import TrajectoryWriter, drop_partitions_from

    run = re.sub(r"[^A-Za-z0-9._-]", "-", run_dir.name) or "run"
    drop_partitions_from(run_dir / "trajectories", run, start_step + 1)  # learner steps after the checkpoint
    return TrajectoryWriter(run_dir / "trajectories", run=run, max_per_file=1024, max_seconds=30.0)
