"""The hidden-state source: env states -> text (or token ids) -> engine -> JAX (N, H) on the policy's device.

    src = HiddenStateSource(engine, cfg, env_kind, timer)
    fresh = src.hidden(src.texts(env_state, pool.env_state))   # phases "render" and "llm" on `timer`

With --num-seeds K the env states carry a leading seed axis: the K seeds' envs (and reset pools) are
rendered and encoded in one engine call (one big batch: the point of running seeds together), seed-major,
and the hidden states come back as (K, N [+ P], H). With --devices D (rl/shards.py) the env states carry a
shard axis (after the seed axis): the shards' envs are rendered in shard order as one batch of N, and the
hidden states come back replicated on every device (each shard installs its rows).

Two paths, chosen once per engine by `engine_takes_token_ids`: an in-process engine that tokenizes and
returns device tensors gets compact observations rendered straight to token ids (each piece tokenized
once, equal to tokenizing the text) and hands its (N, H) tensor to JAX through DLPack; any other engine
gets texts and returns a host array.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from thinkcraft.train.ppo_hidden.config import PPOHiddenConfig, make_prompt_prefix
from thinkcraft.utils.errors import UserError


class EngineFailed(RuntimeError):
    """An engine call failed after the engine's own retries (the loop turns it into a one-line error)."""


class FreshHidden(NamedTuple):
    """One refresh's result."""

    hidden: Any  # (N, H) raw hidden states of a snapshot taken at a refresh point (JAX, policy device)
    suffix_tokens: float  # mean per-env suffix length in tokens (NaN where the engine took texts)


def engine_takes_token_ids(engine: Any) -> bool:
    """Can this engine take token ids and return device tensors (tokenize_batch, hidden_states_torch and
    a tokenizer)? Read from the engine's declared capabilities (llm.protocol.Capabilities)."""
    caps = engine.capabilities
    return bool(caps.tokenizer and caps.device_tensors)


def on_policy_gpu(dev: Any) -> bool:
    """Is this CUDA torch device the GPU JAX (the policy) runs on - JAX's first device?"""
    import jax
    import torch

    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return index == jax.devices()[0].local_hardware_id


def to_policy_device(h: Any) -> Any:
    """(N, H) torch hidden states -> a JAX array on the policy's device (JAX's first). The LLM may live
    elsewhere (--engine-device cuda:1, or the CPU): another GPU's output is peer-copied by torch first
    (DLPack cannot cross devices), anything else is placed by JAX."""
    import jax

    from thinkcraft.llm.dlpack import torch_to_jax

    target = jax.devices()[0]
    if h.device.type == "cuda" and target.platform == "gpu" and not on_policy_gpu(h.device):
        h = h.to(f"cuda:{target.local_hardware_id}")  # ~1 MB
    x = torch_to_jax(h)
    return x if x.devices() == {target} else jax.device_put(x, target)


class HiddenStateSource:
    """Phase 1+2: env states → text → LLM hidden states (N, H) as a JAX array. Times its two phases."""

    def __init__(self, engine: Any, cfg: PPOHiddenConfig, env_kind: str, timer: Any, shards: Any = None) -> None:
        from thinkcraft.llm.protocol import Batch

        self.engine = engine
        self.cfg = cfg
        self.env_kind = env_kind
        self.timer = timer
        self.prefix = make_prompt_prefix(cfg)
        self.token_path = engine_takes_token_ids(engine)
        self._Batch = Batch
        self._prefix_ids: list[int] | None = None
        self._token_renderer: Any = None
        self.shards = shards
        self._merge_seeds: Any = None  # jitted (K, [D,] n, ...) -> (K * N, ...) of every state leaf

    def texts(self, *env_states: Any) -> list[str] | list[list[int]]:
        """The observations of one or more batches of env states (the envs, then a reset pool's worlds), in
        order, as text, or - compact format on the token path - straight as token ids
        (CompactTokenRenderer: each piece tokenized once, equal to tokenizing the text)."""
        import jax

        from thinkcraft.envs.craftax import unwrap_env_state
        from thinkcraft.envs.text import CompactTokenRenderer, extract, render

        with self.timer.phase("render"):
            # one extract per batch (the envs' states are not copied into one array), one device_get for all
            K = self.cfg.num_seeds
            lead = (K > 1) + (self.shards is not None and self.shards.count > 1)  # seed and shard axes
            if lead and self._merge_seeds is None:
                self._merge_seeds = jax.jit(lambda s: jax.tree.map(lambda x: x.reshape((-1,) + x.shape[lead + 1:]), s))
            sems = jax.device_get([extract(s if not lead else self._merge_seeds(unwrap_env_state(s)))
                                   for s in env_states])
            if K > 1:  # seed-major rows: seed 0's envs, then its pool's worlds, then seed 1's ...
                sems = [jax.tree.map(lambda x: x.reshape((K, -1) + x.shape[1:]), s) for s in sems]
                sem = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1).reshape((-1,) + xs[0].shape[2:]), *sems)
            else:
                sem = sems[0] if len(sems) == 1 else jax.tree.map(lambda *xs: np.concatenate(xs), *sems)
            if self.cfg.text_format == "compact" and self.token_path:
                if self._token_renderer is None:
                    self._token_renderer = CompactTokenRenderer(self.engine.tokenizer)
                return self._token_renderer.render(sem, env_kind=self.env_kind)
            return render(sem, fmt=self.cfg.text_format, env_kind=self.env_kind)

    def hidden(self, texts: list[str] | list[list[int]]) -> FreshHidden:
        """One engine call on all the texts; (N, H) hidden states, (K, N, H) with K seeds."""
        with self.timer.phase("llm"):
            try:
                if self.cfg.hidden_input == "zeros":  # the ablation: no text features, everything else the same
                    fresh = self._zeros(len(texts))
                else:
                    fresh = self._hidden_tokens(texts) if self.token_path else self._hidden_texts(texts)
            except UserError:
                raise
            except Exception as e:  # engine failures after the engine's own retries
                raise EngineFailed(str(e)) from e
        K = self.cfg.num_seeds
        if K > 1:
            fresh = fresh._replace(hidden=fresh.hidden.reshape((K, -1) + fresh.hidden.shape[1:]))
        return fresh if self.shards is None else fresh._replace(hidden=self.shards.replicate(fresh.hidden))

    def _zeros(self, n: int) -> FreshHidden:
        import jax.numpy as jnp

        return FreshHidden(jnp.zeros((n, self.engine.hidden_size), jnp.float32), float("nan"))

    def _hidden_tokens(self, texts: list[str] | list[list[int]]) -> FreshHidden:
        eng, Batch = self.engine, self._Batch
        if self._prefix_ids is None:
            self._prefix_ids, _ = eng.tokenize_batch(Batch([""], prefix=self.prefix))
        if texts and isinstance(texts[0], str):
            _, items = eng.tokenize_batch(Batch(texts, prefix=self.prefix))
        else:
            items = texts
        h = eng.hidden_states_torch(Batch(items, prefix=self._prefix_ids), self.cfg.layer, self.cfg.pooling)
        return FreshHidden(to_policy_device(h), float(np.mean([len(i) for i in items])))

    def _hidden_texts(self, texts: list[str] | list[list[int]]) -> FreshHidden:
        import jax.numpy as jnp

        h = self.engine.hidden_states(self._Batch(texts, prefix=self.prefix), self.cfg.layer, self.cfg.pooling)
        return FreshHidden(jnp.asarray(h, jnp.float32), float("nan"))
