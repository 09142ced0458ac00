"""`--pool-backend ray`: the async loop's engines, rollout pool and judge as Ray actors (pools/ray_backend.py
has the layout and the fault semantics). The coordinator, the engine front, the learner and everything
after them are the local backend's (async_build.py / async_run.py), unchanged.
"""

from __future__ import annotations

import copy
import functools
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from thinkcraft.utils.errors import ConfigError, check

RAY_FIELDS = ("ray_address", "ray_engines", "ray_engine_gpus", "ray_engine_cpus", "ray_env_cpus", "ray_judge_gpus",
              "ray_weight_transport", "ray_bucket_mb", "ray_weight_groups", "ray_start_timeout_s")


def check_ray_config(cfg: Any) -> None:
    """Validate the backend fields (from LLMPolicyConfig.validate); a missing Ray is one line, here."""
    defaults = {f.name: f.default for f in fields(cfg)}
    if cfg.pool_backend != "ray":
        for name in RAY_FIELDS:
            if getattr(cfg, name) != defaults[name]:
                raise ConfigError(name, "applies to the Ray backend only: add --pool-backend ray")
        return
    check(cfg.mode == "async", "pool_backend", "the Ray backend runs the asynchronous pools: add --mode async")
    for name in ("weight_sync", "rollout_devices", "rollout_servers"):
        if getattr(cfg, name) != defaults[name]:
            raise ConfigError(name, "the Ray backend places its own engines: use --ray-engines / --ray-engine-gpus")
    check(cfg.ray_engines >= 1, "ray_engines", "must be >= 1")
    check(cfg.ray_engine_cpus > 0, "ray_engine_cpus", "must be > 0")
    check(cfg.ray_env_cpus > 0, "ray_env_cpus", "must be > 0")
    check(cfg.ray_engine_gpus is None or cfg.ray_engine_gpus >= 0, "ray_engine_gpus", "must be >= 0")
    check(cfg.ray_judge_gpus is None or cfg.ray_judge_gpus >= 0, "ray_judge_gpus", "must be >= 0")
    check(cfg.ray_bucket_mb > 0, "ray_bucket_mb", "must be > 0")
    check(cfg.ray_weight_groups == "per-engine" or cfg.ray_weight_transport != "object_store", "ray_weight_groups",
          "applies to the NCCL weight transport only (--ray-weight-transport object_store has no groups)")
    check(cfg.ray_start_timeout_s > 0, "ray_start_timeout_s", "must be > 0")
    from thinkcraft.pools.ray_backend import require_ray

    require_ray()


@dataclass
class RayPools:
    slots: list[Any]
    rollout: Any
    reward: Any
    """A RewardPool over the judge actor, or None (rule rewards; --judge-engine self: the driver's pool)."""
    transport: str
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for c in reversed(self.closers):
            try:
                c()
            except Exception:  # noqa: BLE001 - the cluster may already be gone; the rest still closes
                pass
        self.closers.clear()


def _transport(cfg: Any, engine_gpus: float, learner_device: Any) -> str:
    """nccl where the learner and the engines are on CUDA devices of their own (NCCL cannot join two ranks on
    one GPU: a one-GPU machine, whose engines share the learner's GPU, uses the object store)."""
    import torch

    cuda = str(learner_device).startswith("cuda") and engine_gpus > 0
    if cfg.ray_weight_transport == "nccl" and not cuda:
        raise ConfigError("ray_weight_transport", "nccl needs the learner and the engines on CUDA devices")
    apart = cuda and (bool(cfg.ray_address) or torch.cuda.device_count() > 1)
    return cfg.ray_weight_transport if cfg.ray_weight_transport != "auto" else ("nccl" if apart else "object_store")


def judge_reward(cfg: Any) -> Any:
    """The judge's RewardFn (in the judge actor): its engine from --judge-engine, as the local loop builds it."""
    from thinkcraft.train.llm_policy.model import make_judge
    from thinkcraft.train.llm_policy.rollout import make_env_and_reward

    return make_env_and_reward(cfg, judge=make_judge(cfg, None, None, None)).reward_fn


def build_ray_pools(cfg: Any, policy: Any, version: int) -> RayPools:
    """Connect (or start Ray), reserve the placement group, start the actors (all at once, then awaited);
    the pieces AsyncRun uses in place of build_slots / build_rollout_pool / build_reward_pool."""
    import torch

    from thinkcraft.pools import ray_backend as RB

    layout = RB.ray_layout(cfg, torch.cuda.is_available())
    out = RayPools([], None, None, _transport(cfg, layout.engine_gpus, policy.learner.device))
    try:
        _build(cfg, policy, version, layout, out)
    except BaseException:
        out.close()  # the actors, the placement group, and the local Ray this run started
        raise
    return out


def _build(cfg: Any, p: Any, version: int, layout: Any, out: RayPools) -> None:
    from dataclasses import replace

    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from thinkcraft.pools import EngineSlot, RewardPool
    from thinkcraft.pools import ray_backend as RB
    from thinkcraft.pools import ray_weights as RW
    from thinkcraft.train.llm_policy.async_build import make_prompt_fn, rollout_settings
    from thinkcraft.train.llm_policy.loop import _seed_everything
    from thinkcraft.train.llm_policy.model import make_engine

    ray = RB.require_ray()
    if RB.connect(cfg.ray_address, hide_device=p.learner.device):
        out.closers.append(ray.shutdown)
    pg = RB.reserve(layout.bundles(), cfg.ray_start_timeout_s)
    out.closers.append(lambda: remove_placement_group(pg))
    uid = uuid.uuid4().hex[:6]

    def actor(cls: Any, name: str, bundle: int, cpus: float, gpus: float, args: Callable[[int], tuple]) -> Any:
        """A replaceable actor in `bundle`; `args(n)`: the constructor's arguments for incarnation n."""
        remote = ray.remote(cls)
        h = RB.ActorHandle(name, lambda n: remote.options(
            name=f"thinkcraft-{uid}-{name}-r{n}", num_cpus=cpus, num_gpus=gpus, max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
        ).remote(*args(n)))
        out.closers.append(h.kill)
        return h

    # engines: a CPU copy of the learner's policy through the object store (a replacement starts from it)
    from thinkcraft.llm.hf.weights import strip_copies

    policy = copy.deepcopy(p.learner.model).to("cpu")
    strip_copies(policy)  # a shared engine's derived copies (device tensors), if one ran already, stay out of the store
    if cfg.finetune != "lora" and cfg.bf16 and layout.engine_gpus > 0:
        import torch

        from thinkcraft.llm.hf.weights import autocast_weights

        autocast_weights(policy, torch.bfloat16)  # GPU actors serve it under bf16 autocast: cast once, here
    model_ref = ray.put(policy)
    engines = []
    for k in range(layout.engines):
        # engine 0's first incarnation draws the driver engine's sampling stream (cfg.seed, as build_policy)
        h = actor(RB._EngineActor, f"engine{k}", k, layout.engine_cpus, layout.engine_gpus,
                  lambda n, k=k: (model_ref, functools.partial(make_engine, tokenizer=p.tokenizer, cfg=cfg),
                                  functools.partial(_seed_everything, cfg.seed + 1_000_003 * k + 7919 * n), version,
                                  int(max(1, layout.engine_cpus)), cfg.bf16))
        # continuous batching on the actor's own thread unless whole calls are asked for (--gen-batching whole)
        engines.append(RB.RayEngine(h, cfg.rollout_timeout_s, continuous=cfg.gen_batching != "whole"))
    starting = [e.actor_handle for e in engines]  # awaited last: they start while the env actors do
    if out.transport == "nccl":
        syncs: list[Any] = RW.nccl_syncs(engines, p.learner.device, cfg.ray_bucket_mb, cfg.rollout_timeout_s,
                                         cfg.ray_weight_groups, version)
    else:
        cache = RW._StoreCache()
        syncs = [RW.ObjectStoreWeights(e, cache, version, cfg.rollout_timeout_s) for e in engines]
    for e, s in zip(engines, syncs):
        e.actor_handle.on_replace.append(s.reset)
        out.slots.append(EngineSlot(e, s, e.actor_handle.name, f"ray:{e.actor_handle.name}"))
    if layout.judge:
        h = actor(RB._JudgeActor, "judge", layout.judge_bundle, 1.0, layout.judge_gpus,
                  lambda n: (functools.partial(judge_reward, cfg),))
        starting.append(h)
        out.reward = RewardPool(RB.RayJudge(h, cfg.rollout_timeout_s), p.env.task.problem,
                                max_groups=cfg.judge_batch_groups)
        out.closers.append(lambda: out.reward.stop(drain=False, timeout_s=5.0))
    # rollout workers: the episode loop in the driver's worker threads, each env in its actor
    settings = replace(rollout_settings(cfg, p.env, p.sampling), env_mode="thread")  # the env lives in its actor
    out.rollout = RB.RayRolloutPool(
        settings, make_prompt_fn(p.tokenizer, cfg.history_turns, settings.sampling), num_workers=cfg.rollout_workers,
        max_queued=cfg.rollout_workers * 2, group_size=cfg.samples_per_prompt, engines=engines,
        start_timeout_s=cfg.ray_start_timeout_s,
        env_actor=lambda w: actor(RB._EnvActor, f"env{w}", layout.env_bundle(w), layout.env_cpus, 0,
                                  lambda n: (settings.env,)))
    RB.wait_ready(starting, "ready", cfg.ray_start_timeout_s)
