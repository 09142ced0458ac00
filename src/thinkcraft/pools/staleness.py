"""Bounded staleness: AReaL's admission rule (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
Reinforcement Learning System for Language Reasoning", §5.1), as pure functions over a small state.

A rollout may start only while

    (η + v + 1) · B  >  accepted + running

with v the learner's current version (updates done), B the batch size in trajectories, `accepted` the
trajectories completed and kept so far (cumulative) and `running` those started and not finished. Every
trajectory started under learner version v is then trained at a version ≤ v + η: with η = 0 exactly one
batch is generated per version and the loop is the synchronous one; η = 1 lets batch v + 1 be generated
while batch v trains. A trajectory dropped after it ran (failed, or a DAPO group with no signal) leaves
`running` without entering `accepted`, so it frees its place for a replacement.

The rule bounds staleness in aggregate; one slow group admitted early can still finish after its peers
were trained. `too_stale` is the per-trajectory guard the coordinator applies when it forms a batch: a
group generated more than η versions before the learner's current one is discarded (`on_discard`) and
played again, so no trained token is ever older than η versions.

Admission is per group of G trajectories (GRPO compares the samples of one prompt): a group starts only
if all its G trajectories fit, i.e. capacity ≥ G.
"""

from __future__ import annotations

from typing import NamedTuple


class StalenessState(NamedTuple):
    max_staleness: int
    """η ≥ 0."""
    batch_size: int
    """B: trajectories per learner update."""
    accepted: int = 0
    running: int = 0


def capacity(s: StalenessState, version: int) -> int:
    """Trajectories that may still start under learner version `version`."""
    return (s.max_staleness + version + 1) * s.batch_size - (s.accepted + s.running)


def can_admit(s: StalenessState, version: int, group_size: int) -> bool:
    return capacity(s, version) >= group_size


def on_start(s: StalenessState, n: int) -> StalenessState:
    return s._replace(running=s.running + n)


def on_accept(s: StalenessState, n: int) -> StalenessState:
    """n trajectories finished and were kept for training."""
    if n > s.running:
        raise ValueError(f"accepting {n} trajectories with only {s.running} running")
    return s._replace(running=s.running - n, accepted=s.accepted + n)


def on_reject(s: StalenessState, n: int) -> StalenessState:
    """n trajectories finished (or failed) and were dropped: their places free up."""
    if n > s.running:
        raise ValueError(f"rejecting {n} trajectories with only {s.running} running")
    return s._replace(running=s.running - n)


def on_discard(s: StalenessState, n: int) -> StalenessState:
    """n accepted (buffered, not yet trained) trajectories were dropped after all (too stale)."""
    if n > s.accepted:
        raise ValueError(f"discarding {n} trajectories with only {s.accepted} accepted")
    return s._replace(accepted=s.accepted - n)


def too_stale(s: StalenessState, train_version: int, policy_version: int) -> bool:
    return train_version - policy_version > s.max_staleness


def staleness_of(train_version: int, policy_version: int) -> int:
    """Updates between the weights that generated a token and the weights that train on it."""
    return train_version - policy_version


def resumed(s: StalenessState, version: int) -> StalenessState:
    """The state after a resume at `version`: the v·B trajectories trained so far are the accepted ones;
    nothing runs (rollouts in flight at the kill were discarded and are played again)."""
    return s._replace(accepted=version * s.batch_size, running=0)
