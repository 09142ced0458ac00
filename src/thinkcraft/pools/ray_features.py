"""ppo-hidden's feature engines as Ray actors (`train ppo-hidden --ray-feature-engines K`, issue 21 item 2).

    eng = ray_feature_engine(lambda device: make_engine("hf:/m", device=device), k=3, gather_device="cuda:0")
    h = eng.hidden_states_torch(batch)       # (N, H) on cuda:0, rows in the batch's order

The same `ShardedEngine` as `--feature-devices` (llm/sharded.py: contiguous shards, gathered in order, a
failed or silent shard's engine replaced and the shard retried), with each engine an actor of its own
process on a GPU Ray gives it, instead of an in-process engine on `cuda:k`. Why both: in-process engines
share one interpreter with the training loop and with each other (their host work takes turns on its lock);
actors do not, and they can live on other nodes (`--ray-address`). Token ids go in, (N, H) float32 hidden
states come back through the object store (136 rows x 2,560 floats is 1.4 MB a refresh) and are copied to
the gather device.

    driver (the PPO loop)                         Ray actors, one GPU each (num_gpus=1; CPU when none)
    ---------------------                         -----------------------------------------------------
    ShardedEngine(RayFeatureEngine x K)           _FeatureActor: build(device) -> the hf engine
      tokenizer: engine 0's, fetched once   <---    describe(): hidden size, layers, the tokenizer
      shard k -> actor k ------------------->      hidden(prefix ids, item ids, layer, pooling) -> numpy

A local Ray (started here when none runs and no `--ray-address` is given) does not see the policy's GPU:
the actors get the others (`pools.ray_backend.connect`); with fewer GPUs than actors they share them
(`gpus_per_actor`). Faults: an actor that raises, dies or does not answer within `feature_timeout_s` is
killed and a fresh one built in its place (ShardedEngine's restart, at most `feature_retries` per refresh);
`close()` kills the actors and stops a Ray started here.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Literal

import numpy as np

from thinkcraft.llm.batching import tokenize_batch
from thinkcraft.llm.protocol import Batch, Capabilities, Completion, EngineCapabilityError, EngineError, SamplingParams
from thinkcraft.pools.ray_backend import actor_failure

log = logging.getLogger(__name__)


class _FeatureActor:
    """One hidden-state engine in its own process: `build(device)` makes it on the actor's GPU (or CPU)."""

    def __init__(self, build: Callable[[str], Any], threads: int) -> None:
        import torch

        torch.set_num_threads(max(1, threads))
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.engine = build(self.device)
        caps = self.engine.capabilities
        if not (caps.hidden_states and caps.tokenizer):
            raise EngineCapabilityError("a Ray feature engine must be an in-process engine with hidden states and "
                                        "a tokenizer (hf:...)")

    def describe(self) -> dict[str, Any]:
        caps = self.engine.capabilities
        return {"hidden_size": caps.hidden_size, "num_layers": caps.num_layers, "device": caps.device,
                "tokenizer": self.engine.tokenizer}

    def hidden(self, prefix: list[int], items: list[list[int]], layer: int, pooling: str) -> np.ndarray:
        h = self.engine.hidden_states_torch(Batch(items, prefix=prefix or None), layer, pooling)
        return h.float().cpu().numpy()


class RayFeatureEngine:
    """One `_FeatureActor` behind the hidden-state half of the Engine protocol (token ids in, tensors out).
    Calls block; the ShardedEngine above runs each in its own thread and enforces the timeout."""

    def __init__(self, actor: Any, name: str, start_timeout_s: float) -> None:
        import ray

        self.actor, self.name = actor, name
        try:
            info = ray.get(actor.describe.remote(), timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise EngineError(f"Ray feature engine {name} did not start within {start_timeout_s:g}s (is a GPU "
                              "free for it? `ray status` lists the cluster's resources)") from None
        except ray.exceptions.RayError as e:
            raise EngineError(f"Ray feature engine {name} failed to start: {actor_failure(e)}") from None
        self.tokenizer = info["tokenizer"]
        self.remote_device = info["device"]
        self._caps = Capabilities(hidden_states=True, generate=False, logprobs=False, prefix_reuse=True,
                                  hidden_size=info["hidden_size"], num_layers=info["num_layers"], token_ids_in=True,
                                  tokenizer=True, device_tensors=True, device="cpu")

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def tokenize_batch(self, batch: Batch) -> tuple[list[int], list[list[int]]]:
        return tokenize_batch(self.tokenizer, batch)

    def hidden_states_torch(self, batch: Batch, layer: int = -1, pooling: Literal["last", "mean"] = "last") -> Any:
        """(N, H) float32 CPU tensor (the ShardedEngine copies it to its gather device)."""
        import ray
        import torch

        prefix, items = self.tokenize_batch(batch)
        if not items:
            return torch.zeros((0, self._caps.hidden_size), dtype=torch.float32)
        try:
            # the object store hands back a read-only array: copied (1.4 MB a refresh) before torch owns it
            return torch.from_numpy(np.array(ray.get(self.actor.hidden.remote(prefix, items, layer, pooling))))
        except ray.exceptions.RayActorError as e:
            raise EngineError(f"Ray feature engine {self.name} died ({type(e).__name__})") from None

    def hidden_states(self, batch: Batch, layer: int = -1, pooling: Literal["last", "mean"] = "last") -> np.ndarray:
        return self.hidden_states_torch(batch, layer, pooling).numpy()

    def generate(self, batch: Batch, sampling: SamplingParams) -> list[Completion]:
        raise EngineCapabilityError("a Ray feature engine computes hidden states only")

    def close(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    abandon = close
    """A hung actor is killed too (nothing in this process waits on it)."""


def gpus_per_actor(cluster_gpus: float, k: int) -> float:
    """One GPU per actor where the cluster has k; fewer GPUs are shared evenly (an actor asking for a whole
    GPU that is not there would wait, not fail); none: CPU actors."""
    return 0.0 if cluster_gpus <= 0 else min(1.0, cluster_gpus / k)


def ray_feature_engine(build: Callable[[str], Any], k: int, gather_device: Any = None, timeout_s: float = 600.0,
                       retries: int = 2, address: str = "", start_timeout_s: float = 600.0) -> Any:
    """A ShardedEngine of `k` Ray feature actors (module doc): `build(device)` makes each one's engine there.
    Joins `address`, or the Ray this process already runs, or starts a local one without the gather device."""
    from thinkcraft.llm.sharded import ShardedEngine
    from thinkcraft.pools.ray_backend import connect, require_ray

    ray = require_ray("--ray-feature-engines")
    started = connect(address, hide_device=gather_device)
    gpus = gpus_per_actor(ray.cluster_resources().get("GPU", 0.0), k)
    threads = max(1, int(ray.cluster_resources().get("CPU", 1) // max(k, 1)))
    actor_cls = ray.remote(num_gpus=gpus, num_cpus=1)(_FeatureActor)
    names = [f"ray-features-{i}" for i in range(k)]

    def factory(name: str) -> Callable[[], RayFeatureEngine]:
        return lambda: RayFeatureEngine(actor_cls.remote(build, threads), name, start_timeout_s)

    try:
        eng = ShardedEngine([factory(n) for n in names], gather_device=gather_device, timeout_s=timeout_s,
                            retries=retries, names=names)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    if started:
        eng.on_close.append(ray.shutdown)
    log.info("ppo-hidden features: %d Ray actor(s), %s GPU each", k, gpus)
    return eng
