"""Pools for asynchronous llm-policy training (DESIGN.md "Async llm-policy: three pools", seeds 002/003).

    RolloutPool   N workers: text-env episodes (thread or child process, timeouts) <-> EngineFront
                  (batched generation, versioned weights, updates between batches)
        | GroupResult: G trajectories, token ids + behaviour logprobs + policy version per turn
    RewardPool    judge rewards, batched (rule rewards are scored inline by the env)
        | scored groups -> ReadyBuffer (dynamic sampling) -> batch of the lowest group ids
    TrainPool     the learner: a LocalPool of one worker (train/llm_policy/async_build.py: TrainWorker) that
                  publishes WeightUpdate v+1 to the EngineFront

Admission by the StalenessManager rule (pools.staleness): with η = 0 the synchronous loop. Every pool
has the same four verbs (pools.contract.Pool: submit / poll / health / stop) and exchanges only picklable
values, so a Ray backend (issue 21) implements the same contract with actors (pools.ray_backend). The same Ray
plumbing also places ppo-hidden's feature engines as actors (pools.ray_features, `--ray-feature-engines`).
"""

from thinkcraft.pools.buffer import ReadyBuffer, group_has_signal
from thinkcraft.pools.contract import (
    Failure, GroupRequest, GroupResult, Pool, PoolHealth, PoolStopped, Trajectory, TurnRecord, split_results, traj_id,
)
from thinkcraft.pools.engine import EngineFault, EngineFront, EngineSlot, EngineStats, FairLock
from thinkcraft.pools.envproc import EnvFault, EnvSpec, LatencyEnv, ProcessEnv, ThreadEnv, make_env_handle
from thinkcraft.pools.local import LocalPool, WorkerContext, WorkFailed
from thinkcraft.pools.reward import RewardPool
from thinkcraft.pools.rollout import RolloutPool, RolloutSettings
from thinkcraft.pools.staleness import StalenessState
from thinkcraft.pools.weights import (
    CopyWeights, HTTPWeights, SharedWeights, WeightSync, WeightUpdate, engine_update, trainable_state, versioned,
)

__all__ = [
    "CopyWeights", "EngineFault", "EngineFront", "EngineSlot", "EngineStats", "EnvFault", "EnvSpec", "FairLock", "Failure",
    "GroupRequest", "GroupResult", "HTTPWeights", "LatencyEnv", "LocalPool", "Pool", "PoolHealth", "PoolStopped",
    "ProcessEnv", "ReadyBuffer", "RewardPool", "RolloutPool", "RolloutSettings", "SharedWeights", "StalenessState",
    "ThreadEnv", "Trajectory", "TurnRecord", "WeightSync", "WeightUpdate", "WorkFailed", "WorkerContext",
    "engine_update", "group_has_signal", "make_env_handle", "split_results", "traj_id", "trainable_state",
    "versioned",
]
