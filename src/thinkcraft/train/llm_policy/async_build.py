"""The pieces of `train llm-policy --mode async`, built once from the config (the loop is async_loop.py):
the policy and learner, the engine slots (shared / copy / HTTP) behind one EngineFront, the rollout and
reward pools, and the learner's worker (one TrainBatch -> one update -> WeightUpdate v+1 to the engines).

Placement: the learner on `--device`; an in-process engine per `--rollout-devices` entry: on the learner's
own device it shares the learner's parameters (`--weight-sync shared`: generation and training take turns,
the learner holding the engine's lock; a second entry for that device gets a copy) or has a copy (`copy`:
they overlap); on any other device a copy; plus one HTTP engine per `--rollout-servers` entry (its server loads each version from a file).
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thinkcraft.llm.weight_files import lora_meta
from thinkcraft.pools import (
    CopyWeights, EngineFront, EngineSlot, EnvSpec, GroupResult, HTTPWeights, LocalPool, RewardPool, RolloutPool,
    RolloutSettings, SharedWeights, WeightUpdate, trainable_state,
)
from thinkcraft.train.llm_policy.config import LLMPolicyConfig
from thinkcraft.train.llm_policy.learner import Learner
from thinkcraft.train.llm_policy.rollout import ChatPrompts


@dataclass(frozen=True)
class TrainBatch:
    """One learner update's groups (the lowest ids waiting), trained at learner version `version`."""

    version: int
    groups: list[GroupResult]


@dataclass(frozen=True)
class TrainResult:
    version: int
    """The learner's version after this update (the weights just published)."""
    stats: dict[str, float]
    groups: list[int]
    traj_ids: list[str]
    staleness: list[int]
    """Per trajectory: version trained at - oldest version that generated it."""
    trajectories: list[Any] = field(default_factory=list)
    train_s: float = 0.0
    """Seconds the update itself took (the learner's device time; waiting for the engine excluded)."""


# ------------------------------------------------------------------------------------------- policy


def env_spec(cfg: LLMPolicyConfig) -> EnvSpec:
    """The rollout workers' env, as a picklable spec (each worker, thread or process, builds its own)."""
    return EnvSpec(cfg.env, difficulty=cfg.difficulty, gsm8k_path=cfg.gsm8k_path, max_turns=cfg.max_turns,
                   format_penalty=cfg.format_penalty, reward="deferred" if cfg.reward == "judge" else "rule",
                   answer_weight=cfg.answer_weight, format_weight=cfg.format_weight, lenient=cfg.lenient_answer,
                   latency_ms=cfg.env_latency_ms, action_format=cfg.action_format,
                   reason_chars=cfg.action_reason_chars, unroll_env_scans=cfg.unroll_env_scans)


def make_prompt_fn(tokenizer: Any, history_turns: int, sampling: Any = None) -> Any:
    """(system prompt, n) -> a group's ChatPrompts: the synchronous loop's prompts (token in, token out), with
    one lock around the shared fast tokenizer (it can fail "Already borrowed" when threads encode at once).
    `sampling`: json answers under a thinking budget open the thought in the prompt, as the sync loop does."""
    lock = threading.Lock()

    def group_prompts(system: str, n: int) -> ChatPrompts:
        with lock:
            return ChatPrompts(tokenizer, system, n, history_turns, lock, sampling=sampling)

    return group_prompts


# -------------------------------------------------------------------------------------------- engines


def device_name(device: Any) -> str:
    """"cuda" as "cuda:<current>" (model._device's resolution), so that one GPU has one name."""
    from thinkcraft.train.llm_policy.model import _device

    return str(_device(str(device)))


def _devices(cfg: LLMPolicyConfig, learner_device: Any) -> list[str]:
    if not cfg.rollout_devices and not cfg.rollout_servers:
        return [device_name(learner_device)]
    return [device_name(d.strip()) for d in cfg.rollout_devices.split(",") if d.strip()]


def build_slots(cfg: LLMPolicyConfig, learner: Learner, tokenizer: Any, own_engine: Any, model_lock: Any,
                run_dir: Path, model_dir: str | None, version: int) -> list[EngineSlot]:
    """One EngineSlot per rollout engine (see the module docstring for the placement). `own_engine` is the
    engine over the learner's parameters (built before the learner, as the sync loop does)."""
    from thinkcraft.llm.clients import HTTPOptions, weights_client
    from thinkcraft.llm.hf.weights import autocast_weights, strip_copies
    from thinkcraft.train.llm_policy.model import make_engine

    lora = cfg.finetune == "lora"
    slots: list[EngineSlot] = []
    learner_dev = device_name(learner.device)
    shared = False
    for k, dev in enumerate(_devices(cfg, learner.device)):
        if dev == learner_dev and cfg.weight_sync == "shared" and not shared:
            shared = True  # one engine shares the learner's parameters; another one on this device is a copy
            # the learner's own parameters: one lock for both, so an update never overlaps a batch
            slots.append(EngineSlot(own_engine, SharedWeights(version, own_engine, learner.autocast),
                                    f"engine{k}-shared", dev, learner.autocast, lock=model_lock))
            continue
        twin = copy.deepcopy(learner.model).to(dev).eval().requires_grad_(False)
        strip_copies(twin)  # a shared engine's shadows and adapter copies, if it ran already, are not this copy's
        if not lora and learner.autocast_dtype is not None and str(dev).startswith("cuda"):
            autocast_weights(twin, learner.autocast_dtype)  # cast once here, not in every decode step (it says why)
        engine = make_engine(twin, tokenizer, cfg)
        sync = CopyWeights(twin, version, on_change=engine.invalidate_prefix_cache, engine=engine)
        slots.append(EngineSlot(engine, sync, f"engine{k}-copy", dev, _autocast(dev, learner)))
    http = HTTPOptions(timeout_s=cfg.rollout_timeout_s, api_key=cfg.rollout_api_key())
    for k, spec in enumerate(s.strip() for s in cfg.rollout_servers.split(",") if s.strip()):
        engine, client = weights_client(spec, model_dir, lora, http)
        slots.append(EngineSlot(engine, HTTPWeights(client, run_dir / "weights", version=-1), f"http{k}", None))
    return slots


def _autocast(device: Any, learner: Learner) -> Any:
    """bf16 autocast around a copy engine's generate on a GPU (as the learner's own `autocast`)."""
    from thinkcraft.llm import compat

    if learner.autocast_dtype is None or not str(device).startswith("cuda"):
        return None
    return lambda: compat.autocast(learner.autocast_dtype)  # no cast cache (compat.autocast says why)


def weight_update(learner: Learner, version: int, slots: list[EngineSlot]) -> WeightUpdate:
    """The learner's weights at `version` for the engines that hold their own (none: shared only)."""
    lora = learner.cfg.finetune == "lora"
    if all(isinstance(s.sync, SharedWeights) for s in slots):
        return WeightUpdate(version)
    def in_process(s: EngineSlot) -> bool:
        return isinstance(s.sync, (SharedWeights, CopyWeights))

    # in-process engines and the Ray backend's NCCL broadcast (`device_tensors`, pools/ray_weights.py) take the
    # tensors on the learner's device (device to device); anything else gets them on the CPU
    local = all(in_process(s) or getattr(s.sync, "device_tensors", False) for s in slots)
    copies = [s for s in slots if isinstance(s.sync, CopyWeights)]
    # only in-process engines, the copies all on one device (the dedicated placement): staged there, in their
    # dtype, by this thread
    like = (copies[0].sync.model if all(in_process(s) for s in slots) and copies
            and len({s.device for s in copies}) == 1 else None)
    return WeightUpdate(version, trainable_state(learner.model, lora, device=None if local else "cpu", like=like),
                        "lora" if lora else "full", meta=lora_meta(learner.model) if lora else None)


def front_batching(cfg: LLMPolicyConfig, slots: list[EngineSlot]) -> str:
    """--gen-batching auto: continuous where every engine batches continuously (in-process hf engines, Ray engine
    actors), else whole calls; an explicit continuous with engines that cannot is a clear error."""
    from thinkcraft.pools.engine import supports_continuous
    from thinkcraft.utils.errors import ConfigError

    able = all(supports_continuous(s.engine) for s in slots)
    if cfg.gen_batching == "continuous" and not able:
        plain = ", ".join(s.name for s in slots if not supports_continuous(s.engine))
        raise ConfigError("gen_batching", f"continuous needs engines that batch continuously (in-process hf "
                                          f"engines, Ray engine actors); {plain} do not: use auto or whole")
    if cfg.gen_batching == "auto":
        return "continuous" if able else "whole"
    return cfg.gen_batching


def build_front(cfg: LLMPolicyConfig, slots: list[EngineSlot], pool: RolloutPool) -> EngineFront:
    return EngineFront(slots, batching=front_batching(cfg, slots), max_batch_rows=cfg.max_generate_batch,
                       batch_wait_s=cfg.gen_batch_wait_ms / 1000.0, expected_rows=pool.expected_rows,
                       max_lag=cfg.max_staleness)


# ---------------------------------------------------------------------------------------------- pools


def rollout_settings(cfg: LLMPolicyConfig, env: Any, sampling: Any) -> RolloutSettings:
    """The rollout workers' settings (local and Ray backends): the env spec, and the sampling with the env's
    answer grammar (`--action-format json`: `rollout.answer_structure` of the main process's `env`, the same
    schema every worker's env checks answers against)."""
    from dataclasses import replace

    from thinkcraft.train.llm_policy.rollout import answer_structure

    return RolloutSettings(
        env=env_spec(cfg), sampling=replace(sampling, n=1, structured=answer_structure(env, sampling)),
        env_mode=cfg.env_workers, step_timeout_s=cfg.env_step_timeout_s,
        episode_timeout_s=cfg.env_episode_timeout_s or None, engine_timeout_s=cfg.rollout_timeout_s)


def build_rollout_pool(cfg: LLMPolicyConfig, tokenizer: Any, env: Any, sampling: Any) -> RolloutPool:
    settings = rollout_settings(cfg, env, sampling)
    return RolloutPool(settings, make_prompt_fn(tokenizer, cfg.history_turns, settings.sampling),
                       num_workers=cfg.rollout_workers, max_queued=cfg.rollout_workers * 2,
                       group_size=cfg.samples_per_prompt)


def build_reward_pool(cfg: LLMPolicyConfig, judge: Any, task: Any, lock: Any) -> RewardPool | None:
    """The judge's pool (None for rule rewards, scored inline by the env); `task` maps seeds to problems."""
    if cfg.reward != "judge":
        return None
    return RewardPool(judge, task.problem, max_groups=cfg.judge_batch_groups, lock=lock)


# -------------------------------------------------------------------------------------------- learner


class TrainWorker:
    """The training pool's one worker: a TrainBatch -> advantages -> learner update -> WeightUpdate v+1
    published to the engines."""

    def __init__(self, cfg: LLMPolicyConfig, learner: Learner, tokenizer: Any, front: EngineFront,
                 slots: list[EngineSlot], model_lock: Any, version: int, carry: Any) -> None:
        self.cfg, self.learner, self.tokenizer, self.front, self.slots = cfg, learner, tokenizer, front, slots
        self.model_lock = model_lock
        self.version = version
        self.carry = carry
        """loop.Carry: REINFORCE's baseline, A*-PO's V* table (checkpointed with the weights)."""
        self.busy_s = 0.0
        """Seconds spent updating (holding the model lock): the learner's device time."""

    def pool(self) -> LocalPool[TrainBatch, TrainResult]:
        return LocalPool("train", lambda b, ctx: self.train(b), num_workers=1, max_queued=1)

    def train(self, batch: TrainBatch) -> TrainResult:
        """One update: the synchronous loop's phase 4 (loop.update_on) on the batch's trajectories."""
        from thinkcraft.train.llm_policy.loop import update_on

        trajs = [t for g in batch.groups for t in g.trajectories]
        with self.model_lock:  # shared-parameter engines wait; the version changes with the weights
            t0 = time.perf_counter()
            stats, self.carry = update_on(self.cfg, self.learner, self.tokenizer, trajs, self.carry)
            self.version += 1
            for s in self.slots:
                if isinstance(s.sync, SharedWeights):
                    s.sync.set_version(self.version)
            train_s = time.perf_counter() - t0
        self.busy_s += train_s
        self.front.publish(weight_update(self.learner, self.version, self.slots))
        return TrainResult(self.version, stats, [g.request.group_id for g in batch.groups],
                           [t.traj_id for t in trajs], [batch.version - t.oldest_version for t in trajs], trajs,
                           train_s)
