"""Between the reward pool and the learner: scored groups wait in a buffer; DAPO's dynamic sampling drops
the groups that carry no signal; a batch is the lowest-id groups (the order they were issued, so with
η = 0 a batch is exactly the synchronous loop's).

Dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", §3.2):
a group whose G rewards all agree has zero group-normalised advantage for every sample, so it adds
nothing to the gradient but dilutes the batch; with `dynamic_sampling` such groups are dropped (counted)
and more groups are sampled until the batch is full.
"""

from __future__ import annotations

from typing import Callable, Sequence

from thinkcraft.pools.contract import GroupResult


def group_has_signal(rewards: Sequence[float], atol: float = 1e-6) -> bool:
    """False when every reward of the group is the same (within atol): no preference among the samples."""
    return len(rewards) > 0 and (max(rewards) - min(rewards)) > atol


class ReadyBuffer:
    """Scored groups waiting for the learner, keyed by group id (a group id enters at most once)."""

    def __init__(self) -> None:
        self._groups: dict[int, GroupResult] = {}

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self._groups.values())

    def add(self, group: GroupResult) -> None:
        gid = group.request.group_id
        if gid in self._groups:
            raise ValueError(f"group {gid} is already buffered (a group is trained at most once)")
        self._groups[gid] = group

    def take(self, num_groups: int) -> list[GroupResult] | None:
        """The `num_groups` lowest-id groups, removed; None while fewer wait."""
        if len(self._groups) < num_groups:
            return None
        ids = sorted(self._groups)[:num_groups]
        return [self._groups.pop(g) for g in ids]

    def remove_where(self, pred: Callable[[GroupResult], bool]) -> list[GroupResult]:
        """Remove and return the groups for which `pred` holds (e.g. too stale to train)."""
        gone = [g for gid, g in sorted(self._groups.items()) if pred(g)]
        for g in gone:
            del self._groups[g.request.group_id]
        return gone

    def group_ids(self) -> list[int]:
        return sorted(self._groups)

    def clear(self) -> list[GroupResult]:
        out = list(self._groups.values())
        self._groups.clear()
        return out
