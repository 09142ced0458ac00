"""The pool contract: what crosses between the rollout, reward and training pools, and the four verbs every
pool backend implements (submit / poll / health / stop).

Every item and result here is a plain, picklable value (frozen dataclasses, lists, numbers, strings): a
backend may move it across threads (local), processes, or machines (Ray, issue 21) without a change.
Nothing here refers to a thread, a lock or a queue: those are the backend's business.

Identity: a *group* is G samples of one problem seed (a GRPO group), named by its `group_id`, issued in
increasing order by the coordinator; a *trajectory* is one sample of a group, `traj_id = "g<group>s<k>"`.
The same group id always plays the same problem (its seed is a pure function of the id), so a group that
failed, or was in flight when a run was killed, is played again under the same id and trained at most once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, Sequence, TypeVar, runtime_checkable

In = TypeVar("In", contravariant=True)
Out = TypeVar("Out", covariant=True)


# ------------------------------------------------------------------------------------------ rollouts


@dataclass(frozen=True)
class GroupRequest:
    """One unit of rollout work: play `num_samples` episodes of problem `seed`."""

    group_id: int
    seed: int
    num_samples: int
    attempt: int = 0
    """0 for the first try; a group re-issued after a failure keeps its id and counts up."""


def traj_id(group_id: int, sample: int) -> str:
    return f"g{group_id}s{sample}"


@dataclass
class TurnRecord:
    """One generated turn of a trajectory, token in / token out: the one record of a turn for the synchronous
    rollout (train/llm_policy/rollout.py), the async rollout pool and the learner (`build_rows`)."""

    obs: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    """Behaviour log-probs from the engine (log π_behav of each sampled token, temperature 1)."""
    train_mask: list[int]
    """1 on sampled tokens, 0 on tokens the engine forced (thinking-budget close)."""
    text: str
    finish_reason: str
    reward: float = 0.0
    invalid: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    policy_version: int = 0
    """Version of the weights that generated the turn's first token."""
    weight_versions: list[tuple[int, int]] = field(default_factory=list)
    """[(first token index, weight version)] as the engine reports them: several entries when it took new
    weights mid-turn at a decode-step boundary (partial rollouts); [] when the engine reports none."""
    thinking_tokens: int = 0
    """Tokens inside `<think>` this turn (counted by the engine)."""
    thinking_budget: int | None = None
    prefill_tokens: int = 0
    """Prompt tokens the engine ran through the model this turn (0 when unknown: engines without continuous
    batching)."""
    reused_tokens: int = 0
    """Prompt tokens whose KV the engine already held (shared prefix, earlier turns)."""
    shared_prefix_tokens: int = 0
    """Of `reused_tokens`, the shared prefix's (the rest came from the episode's earlier turns)."""
    template_fallback: bool = False
    """The chat template rewrote earlier turns: this prompt was tokenized whole (no turn-KV reuse)."""
    structured: Any = None
    """The `llm.constrained.StructuredOutput` the answer was decoded under (json answers), else None: its
    `logprobs` are of the constrained distribution, which the learner recomputes (`Learner.allowed_tokens`)."""

    @property
    def version_switch_at(self) -> int | None:
        """Index into `completion_ids` of the first token generated under a newer version than the first
        token's (partial rollouts); None when one version made the turn."""
        return self.weight_versions[1][0] if len(self.weight_versions) > 1 else None

    @classmethod
    def of_completion(cls, obs: str, prompt: list[int], c: Any, reward: float, invalid: bool, info: dict[str, Any],
                      version: int | None = None, **extra: Any) -> TurnRecord:
        """The record of an engine completion `c` (llm.protocol.Completion) for prompt `prompt`, with the env's
        verdict. The policy version is `version` where the caller knows it (a whole-call engine), else the
        engine's first `weight_versions` entry (passed in `extra`)."""
        forced = set(c.forced_token_indices or ())
        versions = list(extra.pop("weight_versions", None) or [])
        if version is None:
            version = versions[0][1] if versions else 0
        ids = c.prompt_token_ids or prompt
        return cls(  # a list the engine handed over is kept, not copied (prompts are never changed in place)
            obs=obs, prompt_ids=ids if type(ids) is list else list(ids), completion_ids=list(c.token_ids),
            logprobs=list(c.logprobs) if c.logprobs is not None else [],
            train_mask=[int(k not in forced) for k in range(len(c.token_ids))], text=c.text,
            finish_reason=str(c.finish_reason), reward=float(reward), invalid=bool(invalid), info=info,
            policy_version=int(version), weight_versions=versions, thinking_tokens=int(c.thinking_tokens), **extra)


@dataclass
class Trajectory:
    """One episode: sample `sample` of group `group` (problem `seed`). The synchronous loop numbers its groups
    within a step; the async coordinator issues global group ids."""

    seed: int
    group: int
    sample: int = 0
    turns: list[TurnRecord] = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    wall_time_s: float = 0.0

    @property
    def traj_id(self) -> str:
        return traj_id(self.group, self.sample)

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def oldest_version(self) -> int:
        """The oldest policy version that contributed a token (what staleness is measured from)."""
        return min((t.policy_version for t in self.turns), default=0)


@dataclass
class GroupResult:
    request: GroupRequest
    trajectories: list[Trajectory]
    scored: bool = True
    """False until the reward pool has scored it (judge rewards); rule rewards are scored in the env."""


FailureReason = Literal[
    "env_step_timeout", "env_episode_timeout", "env_crashed", "env_error", "engine_error", "reward_error",
    "worker_crashed", "stopped",
]


@dataclass(frozen=True)
class Failure:
    """A unit of work that did not complete: dropped, counted by reason (`rollout/failed/<reason>`)."""

    request: Any
    reason: FailureReason | str
    detail: str = ""


# --------------------------------------------------------------------------------------------- pools


@dataclass(frozen=True)
class PoolHealth:
    """A pool's state at one instant (cumulative counters since it started)."""

    name: str
    workers: int
    """Workers alive now."""
    queued: int
    """Items submitted and not yet taken by a worker."""
    running: int
    """Items a worker is on."""
    done: int
    """Results waiting to be polled."""
    completed: int
    failed: dict[str, int]
    """Failures by reason."""
    restarts: int
    """Workers (or their env processes) replaced after a crash or a hang."""
    busy_s: float
    """Summed worker-seconds spent on items (busy share = busy_s / (workers × wall seconds))."""
    wall_s: float
    """Seconds since the pool started."""

    @property
    def busy_share(self) -> float:
        return self.busy_s / max(self.workers * self.wall_s, 1e-9)


class PoolStopped(RuntimeError):
    """submit() on a pool that is stopping or stopped."""


@runtime_checkable
class Pool(Protocol, Generic[In, Out]):
    """A set of workers turning items into results, behind bounded queues.

    - `submit(item, timeout_s)`: enqueue; blocks while the input queue is full (backpressure) and returns
      False when it stayed full for `timeout_s` (None = wait). Raises PoolStopped after `stop`.
    - `poll(max_items, timeout_s)`: up to `max_items` finished results (`Out` or `Failure`), waiting up
      to `timeout_s` for the first one; [] when none came. Results come in completion order.
    - `health()`: a PoolHealth snapshot; never blocks on a worker.
    - `stop(drain)`: no new items; with drain=True the queued and running items finish first, else they
      are abandoned (reported as Failure(reason="stopped") by the next poll). Idempotent.
    """

    def submit(self, item: In, timeout_s: float | None = None) -> bool: ...

    def poll(self, max_items: int = 64, timeout_s: float = 0.0) -> list[Out | Failure]: ...

    def health(self) -> PoolHealth: ...

    def stop(self, drain: bool = False, timeout_s: float = 30.0) -> None: ...


def split_results(results: Sequence[Any]) -> tuple[list[Any], list[Failure]]:
    """(successes, failures) of a poll."""
    ok = [r for r in results if not isinstance(r, Failure)]
    return ok, [r for r in results if isinstance(r, Failure)]
