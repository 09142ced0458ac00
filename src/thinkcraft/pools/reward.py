"""RewardPool: scores groups whose env deferred the reward (an LLM judge), batched and asynchronous.

Rule rewards are computed inline by the env (a regex per answer costs microseconds: no pool needed); a
group played with `EnvSpec(reward="deferred")` comes out of the rollout pool unscored and is submitted
here. One worker takes every group waiting (up to `max_groups`) and grades all their answers in one judge
call (`envs.textenvs.JudgeReward`), so the judge engine sees large batches while rollouts go on.

A verdict that cannot be parsed scores 0 and is counted (`judge/unparsed`, JudgeReward); a judge call that
fails (after the engine client's own retries) fails the groups with reason "reward_error": they are
played again, never trained unscored.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from thinkcraft.pools.contract import Failure, GroupResult, PoolHealth
from thinkcraft.pools.local import LocalPool, WorkerContext, WorkFailed


class RewardPool:
    def __init__(self, judge: Any, problem_of: Callable[[int], Any], max_groups: int = 64, max_queued: int = 256,
                 lock: Any = None) -> None:
        self.judge = judge
        """A RewardFn: (problems, completions) -> RewardResults (envs.textenvs.JudgeReward)."""
        self.problem_of = problem_of
        """seed -> Problem (the task's own deterministic map)."""
        self.lock = lock
        """Held around each judge call when the judge shares the policy's weights (--judge-engine self)."""
        self._pool: LocalPool[GroupResult, GroupResult] = LocalPool(
            "reward", self._score, num_workers=1, max_queued=max_queued, max_batch=max_groups)

    def submit(self, item: GroupResult, timeout_s: float | None = None) -> bool:
        return self._pool.submit(item, timeout_s)

    def poll(self, max_items: int = 64, timeout_s: float = 0.0) -> list[GroupResult | Failure]:
        return self._pool.poll(max_items, timeout_s)

    def health(self) -> PoolHealth:
        return self._pool.health()

    def stop(self, drain: bool = False, timeout_s: float = 30.0) -> None:
        self._pool.stop(drain, timeout_s)

    def _score(self, groups: list[GroupResult], ctx: WorkerContext) -> list[GroupResult]:
        import contextlib

        turns = [(t.turns[-1], t.seed) for g in groups for t in g.trajectories if t.turns]
        problems = [self.problem_of(seed) for _, seed in turns]
        try:
            with self.lock if self.lock is not None else contextlib.nullcontext():
                results = self.judge(problems, [turn.text for turn, _ in turns])
        except Exception as e:  # noqa: BLE001 - the groups are played again
            raise WorkFailed("reward_error", f"judge call failed: {type(e).__name__}: {e}") from None
        if len(results) != len(turns):
            raise WorkFailed("reward_error", f"the judge returned {len(results)} verdicts for {len(turns)} answers")
        for (turn, _), p, r in zip(turns, problems, results):
            turn.reward = float(r.reward)
            turn.invalid = not r.format_ok
            turn.info.update(correct=bool(r.correct), format_ok=bool(r.format_ok), invalid=not r.format_ok,
                             predicted=r.predicted, gold=p.answer)
        return [replace(g, scored=True) for g in groups]
