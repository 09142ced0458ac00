"""`train ppo-hidden`'s config: PPO's fields plus the LLM, the refresh interval and the overlap."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from thinkcraft.train.ppo import SHAPE_FIELDS as PPO_SHAPE_FIELDS
from thinkcraft.train.ppo import PPOConfig
from thinkcraft.utils.errors import ConfigError, UserError, check

SHAPE_FIELDS = PPO_SHAPE_FIELDS + ("skip_n", "hidden_proj_dim", "layer", "pooling", "text_format", "overlap",
                                   "engine_quantize", "reset_pool_size", "engine_random_weights", "hidden_input")

DEFAULT_INSTRUCTIONS = (
    "You are an expert player of Craftax, a 2D open-world survival game. Below is the current game state. "
    "Think about what matters most for survival and progress.\n"
)


@dataclass
class PPOHiddenConfig(PPOConfig):
    """PPO whose policy also reads a frozen LLM's hidden state of the text observation."""

    env_name: str = "Craftax-Classic-Symbolic-v1"
    """Craftax-Symbolic-v1 | Craftax-Classic-Symbolic-v1 (aliases: craftax, craftax-classic)."""
    num_envs: int = 128
    """Parallel environments (each gets an LLM call per refresh)."""
    num_steps: int = 100
    """Steps per env per update; skip_n must divide it or be a multiple of it."""
    skip_n: int = 25
    """Refresh the hidden states every skip_n env steps (0 = never: plain PPO, no LLM)."""
    engine: str = "hf:default"
    """Engine spec: hf:<path-or-default>, vllm:<path>, sglang+http://host:port."""
    engine_device: str | None = None
    """Device for an in-process hf engine (default: cuda:0 - the policy's GPU - if there is one, else cpu)."""
    feature_devices: tuple[str, ...] = ()
    """In-process hf engines on these devices (e.g. cuda:1 cuda:2 cuda:3), one each: every refresh's texts
    are split over them in contiguous shards and gathered back in order (llm/sharded.py); a failing or
    silent engine is restarted and its shard retried. Empty = one engine (on --engine-device). Several CUDA
    devices here do not run side by side (one process; 4 x H100: 223 ms a refresh on three against 201 ms on
    one): for speed use --ray-feature-engines (83 ms on three actors)."""
    ray_feature_engines: int = 0
    """Feature engines as Ray actors instead (one GPU each, on the GPUs a local Ray sees besides the policy's,
    or on the cluster of --ray-address): each its own process (pools/ray_features.py); the same sharding,
    gathering and restarts as --feature-devices. 0 = not used. Needs thinkcraft[ray]."""
    ray_address: str = ""
    """--ray-feature-engines: an existing Ray cluster to place them on ("" = this process's Ray, else a local one)."""
    feature_timeout_s: float = 600.0
    """--feature-devices / --ray-feature-engines: seconds one engine may take for its shard before it counts as
    dead (restarted)."""
    feature_retries: int = 2
    """--feature-devices / --ray-feature-engines: restarts + retries of a failed shard per refresh before the run
    stops (resumable)."""
    engine_api_key_env: str | None = None
    """sglang+http / openai+http engines: send the bearer token held in this environment variable (never on
    the command line, where `ps` shows it)."""
    engine_api_key_file: str | None = None
    """sglang+http / openai+http engines: send the bearer token on the first line of this file."""
    engine_timeout_s: float = 120.0
    """sglang+http / openai+http engines: seconds per request (a refresh of many envs is several requests)."""
    engine_max_batch_tokens: int | None = None
    """Tokens per engine forward chunk (default: the engine's own)."""
    engine_quantize: Literal["none", "fp8"] = "none"
    """hf engine: fp8 runs the frozen LLM's decoder matmuls in FP8 (Hopper/Ada): 1.24-1.30x the prefill
    rate on an H100; activations and weights rounded to 3 mantissa bits (per-token/per-channel scales)."""
    layer: int = -1
    """Which hidden layer to read (-1 = last, final-normed; 0 = embeddings)."""
    pooling: Literal["last", "mean"] = "last"
    """Pool the per-env text's tokens: last real token, or mean."""
    text_format: Literal["compact", "craftax"] = "compact"
    """Text rendering of the observation fed to the LLM."""
    instructions: str = DEFAULT_INSTRUCTIONS
    """Shared prompt prefix before every env's text (prefilled once; the format description is appended)."""
    hidden_proj_dim: int = 64
    """Width of the learned projection of the hidden state into the policy."""
    overlap: bool = False
    """Compute the next refresh's hidden states while the current window runs (one refresh interval stale)."""
    reset_pool_size: int | None = None
    """Fresh worlds generated at each refresh point for the envs whose episode ends before the next one,
    encoded with the refresh so that a reset env acts on its new world's hidden state (rl/hidden.py).
    None = num_envs / optimistic_reset_ratio (+6% LLM work per refresh at ratio 16); larger = fewer shared
    worlds for +P/num_envs LLM work; 0 = the old scheme: a fresh world every step, the hidden input masked
    after a reset until the next refresh."""
    engine_random_weights: int | None = None
    """hf engine: replace the model's weights by a random initialisation (the model's own initialiser,
    this seed): same architecture and tokenizer, no knowledge - the control for "more inputs" vs "an
    LLM's knowledge"."""
    hidden_input: Literal["llm", "zeros"] = "llm"
    """What the policy's hidden-state input receives: the LLM's hidden states, or zeros in their place (an
    ablation: the same network, reset pool and refresh schedule with no text features; the engine is loaded for
    its hidden size but never called) - it separates "the observation's text, encoded" from ppo-hidden's other
    differences to plain PPO (bench/llm_features.py's `blank` arm)."""
    overlap_env_sms: int = 16
    """With --overlap and an in-process LLM on the policy's GPU: SMs kept free of LLM work for the env steps
    (the LLM runs on a CUDA green context of the others). 0 = no partition (the two then nearly serialise)."""

    def validate(self) -> None:
        super().validate()
        check(self.skip_n >= 0, "skip_n", "must be >= 0 (0 = never)")
        if self.skip_n > 0:
            T, S = self.num_steps, self.skip_n
            if T % S and S % T:
                divs = [d for d in range(1, T + 1) if T % d == 0]
                near = sorted(set(divs + [T * 2, T * 4]), key=lambda d: abs(d - S))[:3]
                raise ConfigError("skip_n", f"{S} must divide num_steps={T} or be a multiple of it "
                                  f"(refreshes happen at window boundaries); nearest valid: {near}, "
                                  f"or change --num-steps")
        check(self.hidden_proj_dim > 0, "hidden_proj_dim", "must be > 0")
        check(self.reset_pool_size is None or self.reset_pool_size >= 0, "reset_pool_size",
              "must be >= 0 (0 = the masked scheme)")
        self._check_http_fields()
        if self.engine_random_weights is not None and not is_hf_spec(self.engine):
            raise ConfigError("engine_random_weights", f"applies to the in-process hf engine, not {self.engine!r}")
        if self.hidden_input == "zeros" and self.engine_random_weights is not None:
            raise ConfigError("hidden_input", "zeros replaces the LLM's hidden states: --engine-random-weights would "
                              "change nothing the policy sees; give one of the two")
        check(self.overlap_env_sms >= 0, "overlap_env_sms", "must be >= 0 (0 = no SM partition)")
        if self.engine_quantize != "none" and not is_hf_spec(self.engine):
            raise ConfigError("engine_quantize", f"applies to the in-process hf engine, not {self.engine!r} "
                              f"(quantise a served model in its server: vLLM/SGLang --quantization fp8)")
        if "Pixels" in self.env_name:
            raise ConfigError("env_name", "ppo-hidden uses symbolic observations; pick a -Symbolic- env")
        if self.feature_devices:
            self._check_feature_devices()
        if self.ray_feature_engines or self.ray_address:
            self._check_ray_features()
        check(self.coordinator_address is None, "coordinator_address",
              "multi-host runs are for train ppo; ppo-hidden splits its envs over one host's --devices")

    def _check_http_fields(self) -> None:
        """The served engines' options: not for an in-process engine; a key source that cannot be read is an
        error now, before anything compiles."""
        from thinkcraft.utils.apikey import resolve_config_key

        check(self.engine_timeout_s > 0, "engine_timeout_s", "must be > 0")
        given = [n for n in ("engine_api_key_env", "engine_api_key_file") if getattr(self, n)]
        if given and is_hf_spec(self.engine):
            raise ConfigError(given[0], f"applies to sglang+http / openai+http engines, not {self.engine!r}")
        resolve_config_key(None, self.engine_api_key_env, self.engine_api_key_file,
                           names=("engine_api_key", "engine_api_key_env", "engine_api_key_file"))

    def _check_feature_devices(self) -> None:
        import re

        devs = self.feature_devices
        if not is_hf_spec(self.engine):
            raise ConfigError("feature_devices", f"places in-process hf engines, not {self.engine!r} "
                              f"(a served engine shards over its own GPUs: SGLang --dp-size)")
        check(self.engine_device is None, "feature_devices", "replaces --engine-device (give the devices there)")
        bad = [d for d in devs if not re.fullmatch(r"cpu|cuda(:\d+)?", d)]
        check(not bad, "feature_devices", f"devices are cpu or cuda:N, not {bad}")
        check(len(set(devs)) == len(devs) or set(devs) == {"cpu"}, "feature_devices", f"a device twice: {list(devs)}")
        check(self.feature_timeout_s > 0, "feature_timeout_s", "must be > 0")
        check(self.feature_retries >= 0, "feature_retries", "must be >= 0")
        if any(d.startswith("cuda") for d in devs):
            import torch

            n = torch.cuda.device_count()
            missing = [d for d in devs if d.startswith("cuda") and int((d.split(":") + ["0"])[1]) >= n]
            check(not missing, "feature_devices", f"{missing}: torch sees {n} CUDA device(s)")

    def _check_ray_features(self) -> None:
        check(self.ray_feature_engines >= 0, "ray_feature_engines", "must be >= 0 (0 = not used)")
        check(self.ray_feature_engines > 0, "ray_address", "places --ray-feature-engines; give their number too")
        if not is_hf_spec(self.engine):
            raise ConfigError("ray_feature_engines", f"runs in-process hf engines in the actors, not {self.engine!r}")
        check(not self.feature_devices, "ray_feature_engines", "replaces --feature-devices (give one of the two)")
        check(self.engine_device is None, "ray_feature_engines", "places the engines itself (drop --engine-device)")
        check(self.feature_timeout_s > 0, "feature_timeout_s", "must be > 0")
        check(self.feature_retries >= 0, "feature_retries", "must be >= 0")
        from thinkcraft.pools.ray_backend import require_ray

        try:
            require_ray("--ray-feature-engines")
        except UserError as e:
            raise ConfigError("ray_feature_engines", str(e)) from None

    def check_devices(self, count: int) -> None:
        super().check_devices(count)
        check(self.pool_size % count == 0, "reset_pool_size",
              f"the reset pool's {self.pool_size} worlds must split evenly over {count} devices")

    @property
    def pool_size(self) -> int:
        """Worlds in each refresh's reset pool (0: no pool, the masked scheme)."""
        if self.reset_pool_size is None:
            return max(1, self.num_envs // self.reset_ratio)
        return self.reset_pool_size

    @property
    def window_steps(self) -> int:
        """Env steps between two refresh points inside an update (the jitted window's length)."""
        return min(self.skip_n, self.num_steps)

    @property
    def windows_per_update(self) -> int:
        return self.num_steps // self.window_steps

    @property
    def updates_per_refresh(self) -> int:
        """1 when refreshes happen inside every update; skip_n / num_steps when they skip updates."""
        return max(1, self.skip_n // self.num_steps)

    def refreshes_in(self, update: int) -> bool:
        """Does this update refresh the hidden states (before each of its windows)?"""
        return update % self.updates_per_refresh == 0

    def ppo_config(self) -> PPOConfig:
        """The plain-PPO part of this config (the `skip_n = 0` path runs it)."""
        known = {f.name for f in dataclasses.fields(PPOConfig)}
        return PPOConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in known})


def is_hf_spec(spec: str) -> bool:
    from thinkcraft.llm.registry import parse_spec

    return parse_spec(spec).scheme == "hf"


def engine_options(cfg: PPOHiddenConfig) -> dict[str, Any]:
    """make_engine keyword options: an in-process hf engine's, or a served engine's HTTP options."""
    if not is_hf_spec(cfg.engine):
        http = {"timeout_s": cfg.engine_timeout_s, "api_key_env": cfg.engine_api_key_env,
                "api_key_file": cfg.engine_api_key_file}
        return {k: v for k, v in http.items() if v is not None}
    opts: dict[str, Any] = {}
    if cfg.engine_device:
        opts["device"] = cfg.engine_device
    else:
        import torch

        if torch.cuda.is_available():
            # by name, the policy's GPU (JAX's first device is torch's cuda:0 under the same CUDA_VISIBLE_DEVICES):
            # torch's "cuda" is the thread's current GPU, and JAX's GPU client leaves the last one current when it
            # starts (2 x H200, 2026-11-29: a learner meant for cuda:0 went to cuda:1 after a JAX start)
            opts["device"] = "cuda:0"
    if cfg.engine_max_batch_tokens:
        opts["max_batch_tokens"] = cfg.engine_max_batch_tokens
    if cfg.engine_quantize != "none":
        opts["quantize"] = cfg.engine_quantize
    if cfg.engine_random_weights is not None:
        opts["random_weights"] = cfg.engine_random_weights
    return opts


def build_engine(cfg: PPOHiddenConfig) -> Any:
    """The run's hidden-state engine: `cfg.engine` built once, or with --feature-devices one per device
    (--ray-feature-engines: one per Ray actor) behind a ShardedEngine that gathers onto the policy's device
    (JAX's first: a GPU's torch twin, else the first engine's device)."""
    import functools

    from thinkcraft.llm import make_engine

    if not cfg.feature_devices and not cfg.ray_feature_engines:
        return make_engine(cfg.engine, **engine_options(cfg))
    import jax

    from thinkcraft.llm.sharded import ShardedEngine

    policy = jax.devices()[0]
    gather = f"cuda:{policy.local_hardware_id}" if policy.platform == "gpu" else None
    opts = engine_options(cfg)
    if cfg.ray_feature_engines:
        from thinkcraft.pools.ray_features import ray_feature_engine

        return ray_feature_engine(functools.partial(feature_engine_on, cfg.engine, opts), cfg.ray_feature_engines,
                                  gather_device=gather, timeout_s=cfg.feature_timeout_s, retries=cfg.feature_retries,
                                  address=cfg.ray_address)
    if sum(d.startswith("cuda") for d in cfg.feature_devices) > 1:
        import logging

        logging.getLogger(__name__).warning(
            "--feature-devices: %d in-process engines do not run side by side (measured on 4 x H100: a refresh "
            "took 223 ms on three against 201 ms on one); --ray-feature-engines %d runs each in its own process "
            "(83 ms on three)", len(cfg.feature_devices), len(cfg.feature_devices))
    return ShardedEngine([lambda d=d: make_engine(cfg.engine, **opts, device=d) for d in cfg.feature_devices],
                         gather_device=gather, timeout_s=cfg.feature_timeout_s, retries=cfg.feature_retries,
                         names=list(cfg.feature_devices))


def feature_engine_on(spec: str, opts: dict[str, Any], device: str) -> Any:
    """`make_engine(spec, **opts)` on `device`: what each Ray feature actor builds (a module-level function, so
    that the actor process imports it rather than unpickling a closure)."""
    from thinkcraft.llm import make_engine

    return make_engine(spec, **opts, device=device)


def make_prompt_prefix(cfg: PPOHiddenConfig) -> str:
    """The shared prefix of every env's prompt: instructions, the compact format's convention, a header."""
    from thinkcraft.envs.text import COMPACT_FORMAT_DOC

    doc = COMPACT_FORMAT_DOC.strip() + "\n" if cfg.text_format == "compact" else ""
    return cfg.instructions + doc + "Observation:\n"
