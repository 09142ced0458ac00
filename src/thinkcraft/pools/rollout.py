"""RolloutPool: N workers, each playing one group at a time (G episodes of one problem seed) in its own
text env, against the shared engine front (batched generation, versioned weights).

Per turn: prompts of the group's active episodes (`prompt_fn(system, n)` gives the group's `GroupPrompts`,
whose `next` builds them from the new observations and the last completions: train/llm_policy/rollout.py's
ChatPrompts, the synchronous loop's prompts) -> `EngineFront.run` (token ids + behaviour logprobs, and the
weight versions that made them) -> `env.step` -> one `TurnRecord` per active episode. Token in, token out: the
engine's ids and logprobs are kept, never re-tokenized (a whole-history prompt extends the previous prompt
with the reply's sampled ids). With a continuously batching front the group's turns stay on one engine, which
keeps each episode's KV between turns (released when the episode ends) and the system prompt's once; the
first turn sizes the engines' KV caches for every worker's group (`_reserve`).

Faults become dropped, counted groups (`Failure(reason)`), never a crashed run: an env step past
`step_timeout_s`, an episode past `episode_timeout_s`, an env that crashed or raised (its process or
thread-env is replaced for the next group), an engine call that failed or timed out.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Protocol, Sequence

from thinkcraft.llm.protocol import Completion, SamplingParams
from thinkcraft.pools.contract import Failure, GroupRequest, GroupResult, PoolHealth, Trajectory, TurnRecord
from thinkcraft.pools.engine import EngineFault, EngineFront
from thinkcraft.pools.envproc import EnvFault, EnvSpec, make_env_handle
from thinkcraft.pools.local import LocalPool, WorkerContext, WorkFailed



class GroupPrompts(Protocol):
    """A group's prompt builder. Optional members (train/llm_policy/rollout.py's ChatPrompts has them):
    `append_only` (prompts only grow: an engine may keep each episode's KV), `prefix_len(ids)` (the shared
    prefix's length in a prompt) and `chats[i].fallback` (the template rewrote episode i's history)."""

    def next(self, idx: Sequence[int], obs: Sequence[str], comps: Sequence[Completion | None]) -> list[list[int]]:
        """The next prompts' token ids of episodes `idx`: their new observations, their last completions
        (None on the first turn)."""
        ...


PromptFn = Callable[[str, int], GroupPrompts]
"""(the env's system prompt, episodes in the group) -> the group's prompt builder."""


@dataclass(frozen=True)
class RolloutSettings:
    env: EnvSpec
    sampling: SamplingParams
    env_mode: Literal["thread", "process"] = "thread"
    step_timeout_s: float | None = 60.0
    """An env call (reset/step) past this is a hang: the env is killed/replaced, the group dropped."""
    episode_timeout_s: float | None = None
    """A group whose episodes run past this (env + engine time) is dropped."""
    engine_timeout_s: float | None = 600.0
    """A generate call that gets no answer within this fails the group."""


class RolloutPool:
    """The pool contract for GroupRequest -> GroupResult (see pools.contract.Pool), local backend."""

    def __init__(self, settings: RolloutSettings, prompt_fn: PromptFn, num_workers: int, max_queued: int,
                 group_size: int) -> None:
        self.settings = settings
        self.prompt_fn = prompt_fn
        self.group_size = group_size
        self.num_workers = num_workers
        self.front: EngineFront | None = None
        self._lock = threading.Lock()
        self._active_rows: dict[int, int] = {}
        self._not_started = 0
        self._envs: dict[int, Any] = {}
        self._env_restarts_closed = 0
        self._reserved = False
        self._pool: LocalPool[GroupRequest, GroupResult] = LocalPool(
            "rollout", self._play, num_workers=num_workers, max_queued=max_queued)

    def attach(self, front: EngineFront) -> None:
        self.front = front

    # ---------------------------------------------------------------------------------------- contract

    def submit(self, item: GroupRequest, timeout_s: float | None = None) -> bool:
        with self._lock:
            self._not_started += 1
        ok = self._pool.submit(item, timeout_s)
        if not ok:
            with self._lock:
                self._not_started -= 1
        return ok

    def poll(self, max_items: int = 64, timeout_s: float = 0.0) -> list[GroupResult | Failure]:
        return self._pool.poll(max_items, timeout_s)

    def health(self) -> PoolHealth:
        h = self._pool.health()
        env_restarts = sum(e.restarts for e in self._envs.values())
        return replace(h, restarts=h.restarts + env_restarts)

    def stop(self, drain: bool = False, timeout_s: float = 30.0) -> None:
        self._pool.stop(drain, timeout_s)
        for env in list(self._envs.values()):
            env.close()

    # --------------------------------------------------------------------------------- engine barrier

    def expected_rows(self) -> int:
        """Rows that could be waiting for the engine now: the running episodes, plus the episodes of queued
        groups that a free worker starts at once. The engine front batches when all of them wait."""
        with self._lock:
            free = max(0, self.num_workers - len(self._active_rows))
            return sum(self._active_rows.values()) + self.group_size * min(self._not_started, free)

    def _set_active(self, group_id: int, rows: int | None) -> None:
        with self._lock:
            if rows is None:
                self._active_rows.pop(group_id, None)
            else:
                self._active_rows[group_id] = rows
        if self.front is not None:
            self.front.notify()

    def _reserve(self, first_prompt: list[int], prefix: int, keep_kv: bool, env_turns: int | None) -> None:
        """Size the engines' KV caches once, from the first prompt (as the synchronous rollout does): every
        worker's group on one engine, each episode's whole history when its KV is kept between turns - the
        built env's turns (`env_turns`: 1 for a single-turn task), not the spec's max_turns, which is only a
        cap: sized for 8 turns, an arith cache read 8x the columns it needed at every decode step (the static
        width reads every column)."""
        with self._lock:  # before the first request of any worker reaches an engine
            if self._reserved:
                return
            s = self.settings
            per_turn = len(first_prompt) - prefix + s.sampling.max_new_tokens + 16
            turns = env_turns if env_turns is not None else s.env.max_turns
            tokens = per_turn * (max(int(turns), 1) if keep_kv else 1)
            self.front.reserve(self.num_workers * self.group_size, tokens, prefix, group_rows=self.group_size)
            self._reserved = True

    # ---------------------------------------------------------------------------------------- worker

    def _env_for(self, worker: int) -> Any:
        if worker not in self._envs:
            self._envs[worker] = make_env_handle(self.settings.env, self.settings.env_mode)
        return self._envs[worker]

    def _play(self, req: GroupRequest, ctx: WorkerContext) -> GroupResult:
        with self._lock:
            self._not_started -= 1
            self._active_rows[req.group_id] = req.num_samples
        try:
            return self._play_group(req, ctx)
        except EnvFault as e:
            raise WorkFailed(e.reason, e.detail) from None
        except EngineFault as e:
            raise WorkFailed("engine_error", str(e)) from None
        finally:
            self._set_active(req.group_id, None)

    def _play_group(self, req: GroupRequest, ctx: WorkerContext) -> GroupResult:
        s = self.settings
        assert self.front is not None, "attach an EngineFront before submitting"
        env = self._env_for(ctx.worker_index)
        t0 = time.perf_counter()

        def timeout() -> float | None:
            if s.episode_timeout_s is None:
                return s.step_timeout_s
            left = s.episode_timeout_s - (time.perf_counter() - t0)
            if left <= 0:
                raise WorkFailed("env_episode_timeout", f"group {req.group_id} ran past {s.episode_timeout_s:g}s")
            return left if s.step_timeout_s is None else min(left, s.step_timeout_s)

        n = req.num_samples
        obs = list(env.call("reset", ([req.seed] * n,), timeout()))
        trajs = [Trajectory(req.seed, req.group_id, k) for k in range(n)]
        group_prompts = self.prompt_fn(env.system_prompt, n)
        # continuous batching: the group stays on one engine, which keeps each episode's KV between turns
        # (prompts that only grow) and stores the shared prefix (the system prompt) once
        keep_kv = self.front.continuous and getattr(group_prompts, "append_only", False)
        episodes = [(req.group_id, req.attempt, k) for k in range(n)] if keep_kv else None
        last: list[Completion | None] = [None] * n
        try:
            while True:
                active = list(env.call("active_indices", (), timeout()))
                self._set_active(req.group_id, len(active))
                if not active:
                    break
                if ctx.stopping:
                    raise WorkFailed("stopped", f"group {req.group_id} abandoned at stop")
                prompts = group_prompts.next(active, [obs[i] for i in active], [last[i] for i in active])
                prefix = group_prompts.prefix_len(prompts[0]) if hasattr(group_prompts, "prefix_len") else 0
                if self.front.sizes_caches:
                    self._reserve(prompts[0], prefix, keep_kv, getattr(env, "max_turns", None))
                results = self.front.run(prompts, [(req.group_id, i) for i in active], s.sampling,
                                         s.engine_timeout_s, prefix_len=prefix, route=req.group_id,
                                         episodes=[episodes[i] for i in active] if episodes else None)
                res = env.call("step", ([r.completion.text for r in results],), timeout())
                ended = []
                for j, i in enumerate(active):
                    trajs[i].turns.append(_turn(obs[i], prompts[j], results[j], res, j, s.sampling,
                                                getattr(group_prompts, "chats", None), i))
                    last[i] = results[j].completion
                    obs[i] = res.observations[j]
                    if res.terminated[j] or res.truncated[j]:
                        trajs[i].terminated, trajs[i].truncated = bool(res.terminated[j]), bool(res.truncated[j])
                        ended.append(i)
                if episodes and ended:
                    self.front.release(None, [episodes[i] for i in ended])
        finally:
            self.front.release(req.group_id, episodes or ())
        wall = time.perf_counter() - t0
        for t in trajs:
            t.wall_time_s = wall
        return GroupResult(req, trajs, scored=s.env.reward == "rule")


def _turn(obs: str, prompt: list[int], r: Any, res: Any, j: int, sampling: SamplingParams, chats: Any,
          i: int) -> TurnRecord:
    """The record of engine result `r` (a GenerationResult) for episode `i`, the env's result row `j`."""
    return TurnRecord.of_completion(
        obs, prompt, r.completion, res.rewards[j], res.infos[j].get("invalid", False), dict(res.infos[j]),
        weight_versions=r.weight_versions, prefill_tokens=r.prefill_tokens,
        reused_tokens=r.reused_tokens, shared_prefix_tokens=r.shared_prefix_tokens,
        thinking_budget=r.thinking_budget if r.thinking_budget is not None else sampling.thinking_budget,
        template_fallback=bool(chats[i].fallback) if chats is not None else False, structured=sampling.structured)
