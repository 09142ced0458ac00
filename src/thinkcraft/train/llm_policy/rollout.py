"""Rollouts: prompts (chat template, history window) -> engine.generate -> env reward; episodes as
trajectory-store records. Token in, token out: sampled ids and logprobs are kept, never re-tokenized."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from thinkcraft.train.llm_policy.config import LLMPolicyConfig


@dataclass
class TurnSample:
    obs: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    train_mask: list[int]
    """1 on sampled tokens, 0 on tokens the sampler forced (thinking budget)."""
    text: str
    finish_reason: str
    reward: float = 0.0
    invalid: bool = False
    info: dict = field(default_factory=dict)

@dataclass
class Episode:
    seed: int
    group: int
    turns: list[TurnSample] = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    wall_time_s: float = 0.0

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

def build_messages(system: str, history: Sequence[tuple[str, str]], obs: str, history_turns: int) -> list[dict]:
    """Chat messages: system, the last K (observation, action) turns, the current observation."""
    msgs = [{"role": "system", "content": system}] if system else []
    for o, a in list(history)[-history_turns:] if history_turns > 0 else []:
        msgs += [{"role": "user", "content": o}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": obs})
    return msgs

def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(x) for x in ids]

def rollout(env, engine, tokenizer, seeds: Sequence[int], samples_per_seed: int, sampling, history_turns: int,
            timer=None, gen_context=None) -> list[Episode]:
    """Play one episode per (seed, sample): the G samples of a seed form group `index of the seed`.

    Each turn, the active episodes' prompts go to the engine in one batch; completions keep the engine's
    token ids and logprobs (never re-tokenized).
    """
    import contextlib
    from dataclasses import replace

    phase = timer.phase if timer is not None else (lambda name: contextlib.nullcontext())
    all_seeds = [int(s) for s in seeds for _ in range(samples_per_seed)]
    episodes = [Episode(seed=s, group=i // samples_per_seed) for i, s in enumerate(all_seeds)]
    t0 = time.perf_counter()
    with phase("env"):
        obs = env.reset(all_seeds)
    histories: list[list[tuple[str, str]]] = [[] for _ in episodes]
    sampling = replace(sampling, n=1)
    while True:
        active = env.active_indices()
        if not active:
            break
        with phase("generate"):
            prompts = [encode_prompt(tokenizer, build_messages(env.system_prompt, histories[i], obs[i], history_turns))
                       for i in active]
            with (gen_context() if gen_context is not None else contextlib.nullcontext()):
                comps = engine.generate(_token_batch(prompts), sampling)
        with phase("env"):
            res = env.step([c.text for c in comps])
        for j, i in enumerate(active):
            c = comps[j]
            forced = set(c.forced_token_indices or ())
            episodes[i].turns.append(TurnSample(
                obs=obs[i], prompt_ids=list(c.prompt_token_ids or prompts[j]), completion_ids=list(c.token_ids),
                logprobs=list(c.logprobs) if c.logprobs is not None else [], train_mask=[int(k not in forced) for k in range(len(c.token_ids))],
                text=c.text, finish_reason=str(c.finish_reason), reward=float(res.rewards[j]),
                invalid=bool(res.infos[j].get("invalid", False)), info=res.infos[j],
            ))
            histories[i].append((obs[i], c.text))
            obs[i] = res.observations[j]
            if res.terminated[j] or res.truncated[j]:
                episodes[i].terminated = bool(res.terminated[j])
                episodes[i].truncated = bool(res.truncated[j])
    wall = time.perf_counter() - t0
    for e in episodes:
        e.wall_time_s = wall
    return episodes

def _split_think(text: str) -> tuple[str, str]:
    """(thought, answer) of a `<think>` model's reply; ("", text) when there is no closed thought."""
    head, sep, tail = text.partition("</think>")
    if not sep:
        return "", text
    return head.replace("<think>", "").strip(), tail.strip()

def episode_record(e: Episode, env_name: str, policy_version: int, extra: dict[str, Any]):
    from thinkcraft.data.schema import TrajectoryMetadata, TrajectoryRecord, Turn

    turns = [
        Turn(think=_split_think(t.text)[0], act=_split_think(t.text)[1], obs=t.obs, reward=t.reward, done=(k == len(e.turns) - 1),
             prompt_token_ids=np.asarray(t.prompt_ids, dtype=np.int32),
             response_token_ids=np.asarray(t.completion_ids, dtype=np.int32),
             logprobs=np.asarray(t.logprobs, dtype=np.float32),
             loss_mask=np.asarray(t.train_mask, dtype=np.int8))
        for k, t in enumerate(e.turns)
    ]
    md = TrajectoryMetadata(env_version=env_name, wall_time=e.wall_time_s, truncated=e.truncated,
                            policy_version=policy_version, seed=e.seed,
                            extra={"group": e.group, "invalid_turns": sum(t.invalid for t in e.turns), **extra})
    return TrajectoryRecord.build(task_id=f"{env_name}/{e.seed}", turns=turns, metadata=md)


# ================================================================================================ run

def make_env_and_reward(cfg: LLMPolicyConfig, judge: tuple[Any, Any] | None = None):
    """The text env with its reward. arith/gsm8k: the `####` rule reward, or with `judge` = (engine, prompt
    format) an LLM judge (`--reward judge`; the loop builds the judge once the policy exists, `make_judge`)."""
    from thinkcraft.envs.textenvs import JudgeReward, RuleReward, make_text_env

    reward_fn = None
    if cfg.env in ("arith", "gsm8k"):
        if judge is not None:
            engine, fmt = judge
            reward_fn = JudgeReward(engine, answer_weight=cfg.answer_weight, format_weight=cfg.format_weight,
                                    format_prompt=fmt)
        else:
            reward_fn = RuleReward(answer_weight=cfg.answer_weight, format_weight=cfg.format_weight,
                                   lenient=cfg.lenient_answer)
    return make_text_env(cfg.env, reward_fn=reward_fn, difficulty=cfg.difficulty, gsm8k_path=cfg.gsm8k_path,
                         max_steps=cfg.max_turns, format_penalty=cfg.format_penalty)

def _prompt_corpus(cfg: LLMPolicyConfig, env) -> list[str]:
    """Texts to train a BPE on for random-weight models: instructions, problems and expected answers."""
    texts = [env.system_prompt] * 10
    if hasattr(env, "task"):
        num_problems = 200 if cfg.model == "random:tiny" else 2000  # tiny is for tests: keep BPE training short
        for s in range(num_problems):
            p = env.task.problem(s)
            texts += [p.question, f"{p.question}\n#### {p.answer}"]
    else:
        obs = env.reset(list(range(4)))
        texts += obs * 50
    return texts

def _seed_of(cfg: LLMPolicyConfig, step: int, i: int) -> int:
    """Problem seed of prompt i at learner step `step` >= 1; step 0 is the A*-PO pool (a disjoint range)."""
    base = cfg.seed * 1_000_003 + (10**9 if step == 0 else step * cfg.prompts_per_step)
    return (base + i) % (2**31 - 1)


def _token_batch(prompts: list[list[int]]):
    from thinkcraft.llm.protocol import Batch

    return Batch(items=prompts)
