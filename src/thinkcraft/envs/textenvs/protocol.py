"""Multi-turn text environments for LLM policies: a batched, gym-like protocol over text.

    obs = env.reset(seeds)                       # one episode per seed (repeat a seed G times for a group)
    res = env.step(actions_text)                 # one text per episode that is still running
    res.observations, res.rewards, res.terminated, res.truncated, res.infos

`step` takes and returns entries for the *active* episodes only, in the order of `env.active_indices()`
before the call; finished episodes drop out (a batch of LLM calls never pays for finished episodes).
`step(actions, indices=[...])` steps only those active episodes (in that order) and leaves the others as
they are: episodes of a continuous-batching rollout move on as soon as their own turn is generated.

Kinds (`make_text_env(name)` builds each):
- `TaskEnv` (arith, gsm8k; task.py): one turn; the completion is graded by a reward function (rule or judge).
- `CraftaxTextEnv` (craftax, craftax-classic; craftax.py): compact text observation per step; the
  completion's action is parsed (invalid → counted, a no-op is played, optional format penalty); env
  reward; a step cap (truncation).

Either kind answers in free text or, with `action_format="json"`, with one JSON object: the env then has an
`answer_schema` (a JSON Schema; None in free text) that a sampler constrains decoding to (jsonformat.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np

from thinkcraft.envs.textenvs.base import RewardFn
from thinkcraft.utils.errors import UserError


class StepResult(NamedTuple):
    observations: list[str]
    """Next observation per episode given to `step` ("" where the episode just ended)."""
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    infos: list[dict[str, Any]]


@runtime_checkable
class TextEnv(Protocol):
    name: str
    system_prompt: str
    max_turns: int

    def reset(self, seeds: Sequence[int]) -> list[str]: ...

    def step(self, actions_text: Sequence[str], indices: Sequence[int] | None = None) -> StepResult: ...

    def active_indices(self) -> list[int]: ...

    def counters(self) -> dict[str, float]: ...


def check_len(actions: Sequence[str], active: list[int]) -> None:
    """`step` takes one action per active episode."""
    if len(actions) != len(active):
        raise ValueError(f"step got {len(actions)} actions for {len(active)} active episodes")


def stepped_indices(active: list[int], indices: Sequence[int] | None) -> list[int]:
    """The episodes a step moves: all active ones, or `indices` (distinct, each active)."""
    if indices is None:
        return active
    idx = [int(i) for i in indices]
    live = set(active)
    if len(set(idx)) != len(idx) or not set(idx) <= live:
        raise ValueError(f"step indices must be distinct active episodes; got {idx}, active {sorted(live)}")
    return idx


def make_text_env(
    name: str,
    reward_fn: RewardFn | None = None,
    difficulty: int = 1,
    gsm8k_path: str | None = None,
    max_steps: int = 32,
    format_penalty: float = 0.0,
    action_format: str = "free",
    reason_chars: int = 0,
    unroll_env_scans: str = "auto",
) -> TextEnv:
    """`arith`, `gsm8k` (needs `gsm8k_path`), `craftax`, `craftax-classic`. `action_format` "json": every turn
    answers with one JSON object (`env.answer_schema`; jsonformat.py), with a reason of at most
    `reason_chars` characters first when > 0."""
    from thinkcraft.envs.textenvs.arith import ArithTask
    from thinkcraft.envs.textenvs.gsm8k import GSM8KTask
    from thinkcraft.envs.textenvs.rewards import RuleReward
    from thinkcraft.envs.textenvs.task import TaskEnv

    if name in ("arith", "gsm8k"):
        reward_fn = reward_fn or RuleReward()
        if name == "arith":
            return TaskEnv(ArithTask(difficulty), reward_fn, action_format, reason_chars)
        if not gsm8k_path:
            raise UserError("--gsm8k-path: the gsm8k env needs a local JSONL/Parquet file (nothing is downloaded)")
        return TaskEnv(GSM8KTask(gsm8k_path), reward_fn, action_format, reason_chars)
    if name in ("craftax", "craftax-classic"):
        from thinkcraft.envs.textenvs.craftax import CraftaxTextConfig, CraftaxTextEnv

        return CraftaxTextEnv(CraftaxTextConfig(env_kind=name, max_steps=max_steps, format_penalty=format_penalty,
                                                action_format=action_format, reason_chars=reason_chars,
                                                unroll_env_scans=unroll_env_scans))
    raise UserError(f"unknown text env {name!r}: use arith, gsm8k, craftax or craftax-classic")
