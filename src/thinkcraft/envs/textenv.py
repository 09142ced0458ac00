"""Multi-turn text environments for LLM policies: a batched, gym-like protocol over text.

    obs = env.reset(seeds)                       # one episode per seed (repeat a seed G times for a group)
    res = env.step(actions_text)                 # one text per episode that is still running
    res.observations, res.rewards, res.terminated, res.truncated, res.infos

`step` takes and returns entries for the *active* episodes only, in the order of `env.active_indices()`
before the call; finished episodes drop out (a batch of LLM calls never pays for finished episodes).
`step(actions, indices=[...])` steps only those active episodes (in that order) and leaves the others as
they are: episodes of a continuous-batching rollout move on as soon as their own turn is generated.

Kinds:
- `TaskEnv` (arith, gsm8k): one turn; the completion is graded by a reward function (rule or judge).
- `CraftaxTextEnv` (craftax, craftax-classic): compact text observation per step; the completion's action
  is parsed (invalid → counted, a no-op is played, optional format penalty); env reward; a step cap
  (truncation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np

from thinkcraft.envs.tasks.base import Problem, RewardFn, Task
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


def _check_len(actions: Sequence[str], active: list[int]) -> None:
    if len(actions) != len(active):
        raise ValueError(f"step got {len(actions)} actions for {len(active)} active episodes")


def _stepped(active: list[int], indices: Sequence[int] | None) -> list[int]:
    """The episodes a step moves: all active ones, or `indices` (each active, no repeats)."""
    if indices is None:
        return active
    idx = [int(i) for i in indices]
    live = set(active)
    if len(set(idx)) != len(idx) or not set(idx) <= live:
        raise ValueError(f"step indices must be distinct active episodes; got {idx}, active {sorted(live)}")
    return idx


# ----------------------------------------------------------------------------------- single-turn tasks


class TaskEnv:
    """One question, one answer, graded by `reward_fn`; every episode ends after its first step."""

    max_turns = 1

    def __init__(self, task: Task, reward_fn: RewardFn) -> None:
        self.task = task
        self.reward_fn = reward_fn
        self.name = task.name
        self.system_prompt = task.instructions
        self.problems: list[Problem] = []
        self._active: list[int] = []
        self._num_invalid = 0
        self._num_answers = 0

    def reset(self, seeds: Sequence[int]) -> list[str]:
        self.problems = [self.task.problem(int(s)) for s in seeds]
        self._active = list(range(len(seeds)))
        return [p.question for p in self.problems]

    def active_indices(self) -> list[int]:
        return list(self._active)

    def step(self, actions_text: Sequence[str], indices: Sequence[int] | None = None) -> StepResult:
        stepped = _stepped(self._active, indices)
        _check_len(actions_text, stepped)
        probs = [self.problems[i] for i in stepped]
        results = self.reward_fn(probs, list(actions_text))
        n = len(results)
        self._num_answers += n
        self._num_invalid += sum(not r.format_ok for r in results)
        infos = [
            {"correct": r.correct, "format_ok": r.format_ok, "invalid": not r.format_ok, "predicted": r.predicted,
             "gold": p.answer}
            for r, p in zip(results, probs)
        ]
        gone = set(stepped)
        self._active = [i for i in self._active if i not in gone]
        return StepResult(
            observations=[""] * n,
            rewards=np.array([r.reward for r in results], dtype=np.float32),
            terminated=np.ones(n, dtype=bool),
            truncated=np.zeros(n, dtype=bool),
            infos=infos,
        )

    def counters(self) -> dict[str, float]:
        out = {"format/invalid": float(self._num_invalid), "format/answers": float(self._num_answers)}
        out.update(self.reward_fn.counters())
        return out


# ------------------------------------------------------------------------------------------- craftax


@dataclass(frozen=True)
class CraftaxTextConfig:
    env_kind: str = "craftax-classic"
    """'craftax' (Craftax-Symbolic) or 'craftax-classic'."""
    max_steps: int = 32
    """Episode step cap (truncation): LLM decisions are expensive, episodes are cut short."""
    format_penalty: float = 0.0
    """Subtracted from the reward of a turn whose action could not be parsed (a no-op is played)."""


class CraftaxTextEnv:
    """Craftax with compact text observations (the text package's renderer and action parser).

    All episodes of a reset step together in one jitted, vmapped call; finished episodes keep their
    last state and are stepped with no-ops (masked out), so the compiled batch shape stays fixed.
    """

    def __init__(self, config: CraftaxTextConfig = CraftaxTextConfig()) -> None:
        import os

        # JAX shares the GPU with the torch policy: it must not grab 75% of the memory up front
        # (only effective before JAX's first computation in this process)
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax

        from craftax.craftax_env import make_craftax_env_from_name

        from thinkcraft.envs import text as textpkg

        self.config = config
        self.name = config.env_kind
        self.max_turns = config.max_steps
        self._text = textpkg
        env_name = {"craftax": "Craftax-Symbolic-v1", "craftax-classic": "Craftax-Classic-Symbolic-v1"}.get(config.env_kind)
        if env_name is None:
            raise UserError(f"unknown craftax env kind {config.env_kind!r}: use craftax or craftax-classic")
        self._env = make_craftax_env_from_name(env_name, auto_reset=False)
        self._params = self._env.default_params
        self._noop = int(self._text.parse_action("noop", config.env_kind) or 0)
        game = "Craftax-Classic" if config.env_kind == "craftax-classic" else "Craftax"
        self.system_prompt = (
            f"You play {game}, a 2D survival and crafting game. Each turn you see the text observation; "
            "think briefly, then choose one action.\n" + self._text.COMPACT_FORMAT_DOC + "\n"
            + self._text.action_prompt(config.env_kind)
        )
        env, params = self._env, self._params
        self._reset = jax.jit(jax.vmap(lambda k: env.reset(k, params)))
        self._step = jax.jit(jax.vmap(lambda k, s, a: env.step(k, s, a, params)))
        self._jax = jax
        self._state = None
        self._keys = None
        self._t = np.zeros(0, dtype=np.int64)
        self._done = np.zeros(0, dtype=bool)
        self._num_invalid = 0
        self._num_actions = 0

    def reset(self, seeds: Sequence[int]) -> list[str]:
        jax = self._jax
        import jax.numpy as jnp

        keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray(list(seeds), dtype=jnp.uint32))
        split = jax.vmap(jax.random.split)(keys)
        self._keys, reset_keys = split[:, 0], split[:, 1]
        _, self._state = self._reset(reset_keys)
        n = len(seeds)
        self._t = np.zeros(n, dtype=np.int64)
        self._done = np.zeros(n, dtype=bool)
        return self._render(list(range(n)))

    def _render(self, idx: list[int]) -> list[str]:
        texts = self._text.render_states(self._state, fmt="compact")
        return [texts[i] for i in idx]

    def active_indices(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(~self._done)]

    def step(self, actions_text: Sequence[str], indices: Sequence[int] | None = None) -> StepResult:
        jax = self._jax
        import jax.numpy as jnp

        active = _stepped(self.active_indices(), indices)
        _check_len(actions_text, active)
        n = len(self._done)
        actions = np.full(n, self._noop, dtype=np.int32)
        invalid = np.zeros(n, dtype=bool)
        for i, text in zip(active, actions_text):
            a = self._text.parse_action(text, self.config.env_kind)
            if a is None:
                invalid[i] = True
            else:
                actions[i] = a
        self._num_actions += len(active)
        self._num_invalid += int(invalid.sum())
        # finished episodes keep their final state (no auto-reset), and so do the ones not stepped now; only
        # stepped episodes advance their keys (an episode's randomness does not depend on the others' steps)
        still = np.ones(n, dtype=bool)
        still[active] = False
        keep = jnp.asarray(still)
        split = jax.vmap(lambda k: jax.random.split(k))(self._keys)
        self._keys, step_keys = jnp.where(keep[:, None], self._keys, split[:, 0]), split[:, 1]
        prev_state = self._state
        _, new_state, reward, done, _info = self._step(step_keys, prev_state, jnp.asarray(actions))
        self._state = jax.tree_util.tree_map(
            lambda old, new: jnp.where(keep.reshape((-1,) + (1,) * (new.ndim - 1)), old, new), prev_state, new_state
        )
        reward = np.asarray(reward, dtype=np.float32)
        done = np.asarray(done, dtype=bool)
        self._t[active] += 1
        idx = np.asarray(active, dtype=np.int64)
        terminated = done[idx]
        truncated = (~terminated) & (self._t[idx] >= self.config.max_steps)
        rewards = reward[idx] - self.config.format_penalty * invalid[idx]
        self._done[idx] = terminated | truncated
        obs_all = self._render(active)
        obs = [o if not (te or tr) else "" for o, te, tr in zip(obs_all, terminated, truncated)]
        infos = [{"action": int(actions[i]), "invalid": bool(invalid[i]), "env_reward": float(reward[i])} for i in active]
        return StepResult(obs, rewards.astype(np.float32), terminated, truncated, infos)

    def counters(self) -> dict[str, float]:
        return {"format/invalid": float(self._num_invalid), "format/answers": float(self._num_actions)}


# ------------------------------------------------------------------------------------------- factory


def make_text_env(
    name: str,
    reward_fn: RewardFn | None = None,
    difficulty: int = 1,
    gsm8k_path: str | None = None,
    max_steps: int = 32,
    format_penalty: float = 0.0,
) -> TextEnv:
    """`arith`, `gsm8k` (needs `gsm8k_path`), `craftax`, `craftax-classic`."""
    from thinkcraft.envs.tasks import ArithTask, GSM8KTask, RuleReward

    if name in ("arith", "gsm8k"):
        reward_fn = reward_fn or RuleReward()
        if name == "arith":
            return TaskEnv(ArithTask(difficulty), reward_fn)
        if not gsm8k_path:
            raise UserError("--gsm8k-path: the gsm8k env needs a local JSONL/Parquet file (nothing is downloaded)")
        return TaskEnv(GSM8KTask(gsm8k_path), reward_fn)
    if name in ("craftax", "craftax-classic"):
        return CraftaxTextEnv(CraftaxTextConfig(env_kind=name, max_steps=max_steps, format_penalty=format_penalty))
    raise UserError(f"unknown text env {name!r}: use arith, gsm8k, craftax or craftax-classic")
