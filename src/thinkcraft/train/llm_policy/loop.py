"""The synchronous llm-policy step loop (see the package docstring for the phases)."""

from __future__ import annotations

import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from thinkcraft.utils.errors import ConfigError, UserError
from thinkcraft.train.llm_policy.config import LLMPolicyConfig
from thinkcraft.train.llm_policy.learner import (
    Learner, build_rows, load_checkpoint, row_scores_and_groups, save_checkpoint,
)
from thinkcraft.train.llm_policy.model import (
    _AdapterOffEngine, _device, _LazyEngine, check_engine_for_algo, load_policy, make_engine,
)
from thinkcraft.train.llm_policy.rollout import (
    _prompt_corpus, _seed_of, episode_record, make_env_and_reward, rollout,
)


def run(cfg: LLMPolicyConfig) -> dict[str, Any]:
    import torch

    from thinkcraft.llm.protocol import SamplingParams
    from thinkcraft.rl import llm_losses as L
    from thinkcraft.utils.metrics import MetricsWriter, truncate_metrics
    from thinkcraft.utils.plot import plot_curves
    from thinkcraft.utils.progress import RunProgress
    from thinkcraft.utils.timing import PhaseTimer

    run_dir = Path(cfg.run_dir)
    ckpt_path = run_dir / "checkpoint.pt"
    if not cfg.resume and ckpt_path.exists():
        raise UserError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --run-dir")
    device = _device(cfg.device)
    autocast = torch.bfloat16 if (device.type == "cuda" and cfg.bf16) else None
    base_dtype = torch.bfloat16 if (autocast is not None and cfg.finetune == "lora") else torch.float32
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    holder: dict[str, Any] = {}

    def judge_factory():
        msgs = lambda text: [{"role": "user", "content": text}]  # noqa: E731
        if cfg.judge_engine != "self":
            from thinkcraft.llm import make_engine as make_engine_from_spec

            eng = make_engine_from_spec(cfg.judge_engine, **cfg.judge_engine_options())
            if eng.capabilities.tokenizer:  # in-process engines: their own chat template
                return eng, lambda text: eng.apply_chat_template(msgs(text))
            return eng, None  # HTTP engines receive the plain prompt
        holder["judge_self"] = True  # bound once the policy exists

        def fmt(text: str) -> str:
            return holder["tokenizer"].apply_chat_template(msgs(text), add_generation_prompt=True, tokenize=False)

        return _LazyEngine(holder), fmt

    env = make_env_and_reward(cfg, judge_factory)
    corpus = _prompt_corpus(cfg, env) if cfg.model_spec.scheme == "random" else []
    model, tok = load_policy(cfg, corpus, device, base_dtype)
    holder["tokenizer"] = tok
    if cfg.thinking_budget is not None and not {"<think>", "</think>"} <= set(tok.get_vocab()):
        raise ConfigError("thinking_budget", f"{cfg.model} has no <think>/</think> tokens; drop --thinking-budget")
    engine = make_engine(model, tok, cfg)
    check_engine_for_algo(engine.capabilities, cfg.algo)
    if holder.get("judge_self"):
        holder["engine"] = _AdapterOffEngine(engine, model)
    learner = Learner(cfg, model, tok, device, autocast)
    sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                              logprobs=True, thinking_budget=cfg.thinking_budget)

    start_step, baseline, v_star_table = 0, None, None
    if cfg.resume and ckpt_path.exists():
        start_step, extra = load_checkpoint(ckpt_path, learner)
        baseline = extra.get("baseline")
        v_star_table = extra.get("v_star")
        truncate_metrics(run_dir / "metrics.jsonl", start_step)
    run_dir.mkdir(parents=True, exist_ok=True)
    from thinkcraft.utils.io import atomic_write_json

    atomic_write_json(run_dir / "config.json", asdict(cfg))

    writer = None
    if cfg.store:
        from thinkcraft.data.writer import TrajectoryWriter

        writer = TrajectoryWriter(run_dir / "trajectories", run=_run_name(run_dir), max_per_file=1024, max_seconds=30.0)

    timer = PhaseTimer()
    # A*-PO, offline phase: V*(x) from N reference samples of each prompt in the pool (π_ref = initial policy)
    if cfg.algo == "apo" and v_star_table is None:
        with timer.phase("apo_offline"):
            pool = [_seed_of(cfg, 0, i) for i in range(cfg.apo_pool_size)]
            eps = rollout(env, engine, tok, pool, cfg.apo_ref_samples, sampling, cfg.history_turns,
                          gen_context=learner.autocast)
            r = torch.tensor([e.total_reward for e in eps], dtype=torch.float64).view(len(pool), cfg.apo_ref_samples)
            v = L.apo_value(r, cfg.apo_beta1)
            v_star_table = {int(s): float(x) for s, x in zip(pool, v)}
        print(f"A*-PO: V* from {cfg.apo_ref_samples} samples x {len(pool)} prompts: mean {float(v.mean()):.3f} "
              f"(mean reward {float(r.mean()):.3f}) in {timer.seconds('apo_offline'):.1f}s")

    metrics = MetricsWriter(run_dir)
    last: dict[str, Any] = {}
    try:
        with RunProgress(cfg.steps, "llm-policy", log_every_s=cfg.log_every_s) as progress:
            for step in range(start_step, cfg.steps):
                timer.reset()
                t_step = time.perf_counter()
                # 1-2. rollout (generate + env)
                if cfg.algo == "apo":
                    rng = random.Random(cfg.seed * 1_000_003 + step)  # per step: a resumed run draws the same
                    pool_seeds = sorted(v_star_table)
                    seeds = [pool_seeds[rng.randrange(len(pool_seeds))] for _ in range(cfg.prompts_per_step)]
                else:
                    seeds = [_seed_of(cfg, step + 1, i) for i in range(cfg.prompts_per_step)]
                roll_metrics: dict[str, float] = {}
                episodes = rollout(env, engine, tok, seeds, cfg.samples_per_prompt, sampling, cfg.history_turns, timer,
                                   gen_context=learner.autocast, metrics=roll_metrics)
                turns = [t for e in episodes for t in e.turns]
                # 3. store
                if writer is not None:
                    with timer.phase("store"):
                        for e in episodes:
                            writer.add(episode_record(e, cfg.env, step, {"algo": cfg.algo}), learner_step=step)
                # 4. train
                with timer.phase("train"):
                    scores, groups = row_scores_and_groups(episodes, cfg.gamma, cfg.max_turns)
                    sc = torch.tensor(scores, dtype=torch.float32)
                    gid = torch.tensor(groups, dtype=torch.long)
                    v_rows = None
                    if cfg.algo == "grpo":
                        adv = L.grpo_advantages(sc, gid, scale_by_std=cfg.scale_adv_by_std)
                    elif cfg.algo == "rloo":
                        adv = L.rloo_advantages(sc, gid)
                    elif cfg.algo == "reinforce":
                        b = float(sc.mean()) if baseline is None else baseline
                        adv = L.reinforce_advantages(sc, b)
                        baseline = L.update_running_baseline(baseline, sc, cfg.baseline_momentum)
                    else:
                        v_rows = torch.tensor([v_star_table[e.seed] for e in episodes for _ in e.turns],
                                              dtype=torch.float32, device=device)
                        adv = sc - v_rows.cpu()
                    rows = build_rows(turns, adv.tolist(), scores, tok.pad_token_id, device)
                    loss_stats = learner.update(rows, v_star=v_rows)
                policy_version = step + 1
                step_s = time.perf_counter() - t_step
                # 5. log / checkpoint
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
                    "policy_version": policy_version,
                    "advantage/abs_mean": float(adv.abs().mean()),
                    **loss_stats,
                    **roll_metrics,
                    **timer.metrics(),
                }
                if cfg.env in ("arith", "gsm8k"):
                    rec["reward/correct_rate"] = float(np.mean([t.info.get("correct", False) for t in turns]))
                rec.update({k: v for k, v in env.counters().items() if k.startswith("judge/")})
                last = metrics.write(policy_version, rec)
                progress.update(policy_version, reward=rec["reward/mean"], invalid=rec["format/invalid_rate"],
                                s_per_step=step_s, samples_s=rec["perf/samples_per_s"])
                if (cfg.checkpoint_every and policy_version % cfg.checkpoint_every == 0) or policy_version == cfg.steps:
                    with timer.phase("checkpoint"):
                        if writer is not None:
                            writer.flush()
                        save_checkpoint(ckpt_path, learner, policy_version,
                                        {"baseline": baseline, "v_star": v_star_table, "config": asdict(cfg)})
    finally:
        metrics.close()
        if writer is not None:
            writer.close()
    if cfg.plot:
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curve.png",
                    ["reward/mean", "reward/correct_rate", "format/invalid_rate", "completion/mean_tokens",
                     "perf/samples_per_s"], title=f"llm-policy {cfg.algo} on {cfg.env}")
    return last

def _run_name(run_dir: Path) -> str:
    import re

    name = re.sub(r"[^A-Za-z0-9._-]", "-", run_dir.name) or "run"
    return name
