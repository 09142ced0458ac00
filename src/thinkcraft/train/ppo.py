"""`thinkcraft train ppo`: PPO on Craftax with Craftax_Baselines' defaults, at least as fast.

Outer loop (impure, short): compile once → repeat { jitted chunk of K updates → log → checkpoint }.
Each chunk is one XLA call with the runner state donated, so there is no host sync inside a chunk and
the progress bar/metrics/checkpoints cost nothing on the device's critical path.

`--num-seeds K` trains K independent seeds (seed, seed+1, ...) in that one program: the runner state gets a
leading seed axis and the chunk is vmapped over it (rl/seeds.py; Craftax_Baselines' NUM_REPEATS). Seed i
is the run `--seed seed+i`. Each logged chunk writes one metrics record per seed carrying `seed_index`
(what `thinkcraft compare` reads); the progress line shows the mean over the seeds; checkpoints hold all
K; `eval` / `collect` pick one with `--seed-index`. K = 1 is exactly the single-seed program and format.

`--devices D` splits the envs over D devices in that one program (rl/shards.py: a Mesh over the env axis,
`shard_map`; each device steps num_envs / D envs, each minibatch's gradients are averaged over the devices,
so an update is one device's on the same global batch). D = 1 is exactly the single-device program;
`--devices all` takes every device JAX sees, every host's after `--coordinator-address` (jax.distributed;
README "Scale-out"). Combined with --num-seeds K: each seed's envs are split the same way.

`--policy rnn` is Craftax_Baselines' `ppo_rnn.py` (rl/networks.ActorCriticRNN; the sequence update in
rl/ppo.py). Its defaults are this config's (Baselines' ppo_rnn.py shares ppo.py's: see PPOConfig).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np

from thinkcraft.train.session import RunOptions
from thinkcraft.utils.errors import ConfigError, UserError, check

SHAPE_FIELDS = (
    "env_name", "num_envs", "num_steps", "num_minibatches", "update_epochs", "layer_width",
    "optimistic_reset_ratio", "total_timesteps", "lr", "anneal_lr", "compute_dtype", "seed",
    "updates_per_chunk", "num_seeds", "policy", "devices",
)
# config fields that never shape a traced program: the rest key the program cache (utils/program_cache.py)
PROGRAM_KEY_EXCLUDE = (*(f.name for f in fields(RunOptions)), "seed", "stop_after_updates")


@dataclass
class PPOConfig(RunOptions):
    """PPO on Craftax. Defaults equal Craftax_Baselines `ppo.py` except total_timesteps.

    `--policy rnn` (Baselines' `ppo_rnn.py`) keeps every default: its script defaults are ppo.py's
    (ENV_NAME Craftax-Symbolic-v1, NUM_ENVS 1024, NUM_STEPS 64, LR 2e-4 annealed linearly, UPDATE_EPOCHS 4,
    NUM_MINIBATCHES 8, GAMMA 0.99, GAE_LAMBDA 0.8, CLIP_EPS 0.2, ENT_COEF 0.01, VF_COEF 0.5, MAX_GRAD_NORM
    1.0, LAYER_SIZE 512, optimistic resets with ratio 16). Its network ignores --activation (ReLU, as
    theirs); its minibatches split the envs, so num_minibatches must divide num_envs.

    Differences from Craftax_Baselines that remain (none biases a learning comparison; bench/ppo_parity.py):
    * episode statistics: Baselines logs per update the mean over the episodes that ended in its rollout;
      we log per chunk of `updates_per_chunk` updates the mean over all episodes ended in the chunk (the
      same episode-weighted mean over a longer window). Achievements are fractions of ended episodes
      (theirs percentages: /100); `achievements/mean_rate` is their mean over achievements (Baselines'
      `achievements` is their sum over achievements as fractions). Returns are the same LogWrapper sums of
      rewards since the episode's start, timeouts and deaths both ending it;
    * optimistic resets: the same number P = num_envs / ratio of fresh worlds per step. Baselines gives
      each done env its own world when at most P are done (an argsort) and otherwise P done envs drawn by
      `random.choice(p=done)` their own and the rest world j // ratio; we rank the done envs from a random
      offset and give the k-th world k mod P (envs/craftax.py). Both: unique worlds up to P resets, shared
      beyond; the worlds are i.i.d., so which done env gets which one changes no statistic;
    * PRNG streams: keys are split in another order (same distributions; `--num-seeds` seeds are
      `PRNGKey(seed + i)`, Baselines' NUM_REPEATS `split(PRNGKey(seed), K)`);
    * Pixels envs: Baselines' ppo.py uses a conv net there (ActorCriticConv); ours is the MLP on the flattened
      pixels (the parity comparison is on Symbolic envs);
    * lr annealing: the same formula, lr × (1 − (count // (minibatches × epochs)) / num_updates), counted
      per Adam step; initialisation: the same orthogonal scales and zero biases (flax's GRUCell defaults
      for the RNN's GRU, as theirs).
    """

    env_name: str = "Craftax-Symbolic-v1"
    """Craftax-Symbolic-v1 | Craftax-Classic-Symbolic-v1 | Craftax-Pixels-v1 | Craftax-Classic-Pixels-v1 (aliases: craftax, craftax-classic)."""
    total_timesteps: int = 10_000_000
    """Environment steps in all (Baselines' runs use 1e9). Sets the number of updates and the lr schedule."""
    num_envs: int = 1024
    """Parallel environments."""
    num_steps: int = 64
    """Steps per env per update (rollout length)."""
    lr: float = 2e-4
    """Adam learning rate."""
    anneal_lr: bool = True
    """Anneal the learning rate linearly to 0 over the run."""
    update_epochs: int = 4
    """Passes over each rollout batch."""
    num_minibatches: int = 8
    """Minibatches per epoch; must divide num_envs × num_steps."""
    gamma: float = 0.99
    """Discount."""
    gae_lambda: float = 0.8
    """GAE λ."""
    clip_eps: float = 0.2
    """PPO ratio clip (also clips the value update)."""
    ent_coef: float = 0.01
    """Entropy bonus coefficient."""
    vf_coef: float = 0.5
    """Value loss coefficient."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    layer_width: int = 512
    """Width of the 3 hidden layers of the actor and of the critic."""
    optimistic_reset_ratio: int = 16
    """Fresh worlds generated per step = num_envs / ratio (Baselines: min(16, num_envs)); 1 = a fresh world for every env every step."""
    unroll_env_scans: Literal["auto", "on", "off"] = "auto"
    """Trace craftax's short inner loops (mob / projectile / plant slots, world generation, random.choice's binary searches) unrolled: the same states, no host-driven GPU loop iterations inside a step - plain PPO 21.6k -> 53.9k SPS at 128 envs on an H100 - for ~40 s more compile (envs/unroll.py). auto = on when JAX runs on a GPU (on a CPU the loops cost nothing and the compile would)."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Matmul dtype of the networks (parameters stay float32). float32 = Baselines."""
    seed: int = 0
    """Random seed (parameters, env worlds, actions). With --num-seeds K: seeds seed .. seed+K-1."""
    num_seeds: int = 1
    """Independent seeds trained in one compiled program (vmapped, as Baselines' NUM_REPEATS); seed i equals a
    run with --seed seed+i. Metrics: one record per seed (`seed_index`); `sps` counts all seeds' steps."""
    policy: Literal["mlp", "rnn"] = "mlp"
    """mlp: Baselines' ppo.py actor-critic (3 × layer_width, tanh). rnn: Baselines' ppo_rnn.py (Dense, GRU of
    layer_width, 2-layer ReLU heads; the update runs whole env sequences from the rollout's first memory)."""
    devices: int | Literal["all"] = 1
    """Devices the envs are split over (data-parallel: each steps num_envs / devices envs; each minibatch's
    gradients are averaged across them, so an update equals one device's on the same global batch;
    rl/shards.py). 1 = the single-device program; all = every device JAX sees (every host's with
    --coordinator-address)."""
    coordinator_address: str | None = None
    """Multi-host (README "Scale-out"): jax.distributed's coordinator, process 0's host:port, the same on
    every process; or auto (SLURM / Open MPI / Kubernetes give it, the process count and id)."""
    num_processes: int | None = None
    """Multi-host: the number of processes (one per host); None = detected with --coordinator-address auto."""
    process_id: int | None = None
    """Multi-host: this process's index (0 = the coordinator's host); None = detected."""
    updates_per_chunk: int = 8
    """PPO updates per jitted call; adjusted down to a divisor of the number of updates. Larger = fewer host round trips."""
    stop_after_updates: int = 0
    """Stop (with a checkpoint) after this many updates in this session, to --resume later (0 = run to the end). For time-sliced jobs."""

    def __post_init__(self) -> None:
        from thinkcraft.envs.craftax import canonical_env_name

        try:
            self.env_name = canonical_env_name(self.env_name)
        except UserError as e:
            raise ConfigError("env_name", str(e)) from None
        super().__post_init__()

    def validate(self) -> None:
        from thinkcraft.envs.unroll import UNROLL_SETTINGS

        for f in ("total_timesteps", "num_envs", "num_steps", "update_epochs", "num_minibatches",
                  "layer_width", "updates_per_chunk", "num_seeds"):
            check(getattr(self, f) > 0, f, f"must be > 0, got {getattr(self, f)}")
        check(self.total_timesteps >= self.batch_size, "total_timesteps",
              f"{self.total_timesteps} is less than one update (num_envs × num_steps = {self.batch_size})")
        check(self.batch_size % self.num_minibatches == 0, "num_minibatches",
              f"num_envs × num_steps = {self.batch_size} is not divisible by {self.num_minibatches} minibatches")
        check(self.policy in ("mlp", "rnn"), "policy", f"mlp or rnn, not {self.policy!r}")
        check(self.policy != "rnn" or self.num_envs % self.num_minibatches == 0, "num_minibatches",
              f"--policy rnn splits the envs into minibatches of whole sequences: {self.num_minibatches} must "
              f"divide num_envs={self.num_envs}")
        r = self.optimistic_reset_ratio
        check(r >= 1 and self.num_envs % min(r, self.num_envs) == 0, "optimistic_reset_ratio",
              f"{r} must be >= 1 and divide num_envs={self.num_envs}")
        check(self.lr > 0, "lr", "must be > 0")
        check(0 < self.gamma <= 1, "gamma", "must be in (0, 1]")
        check(0 <= self.gae_lambda <= 1, "gae_lambda", "must be in [0, 1]")
        check(self.stop_after_updates >= 0, "stop_after_updates", "must be >= 0")
        check(self.stop_after_updates % self.chunk_updates == 0, "stop_after_updates",
              f"must be a multiple of the chunk size ({self.chunk_updates} updates) so that the run stops at a chunk end")
        check(self.compute_dtype in ("float32", "bfloat16"), "compute_dtype", "float32 or bfloat16")
        check(self.unroll_env_scans in UNROLL_SETTINGS, "unroll_env_scans", "auto, on or off")
        check(self.devices == "all" or (isinstance(self.devices, int) and self.devices >= 1), "devices",
              f"a number >= 1 or all, not {self.devices!r}")
        if self.devices != "all":
            self.check_devices(self.devices)
        multi = (self.num_processes, self.process_id)
        check(self.coordinator_address is not None or multi == (None, None), "coordinator_address",
              "--num-processes / --process-id need --coordinator-address (host:port or auto)")

    def check_devices(self, count: int) -> None:
        """The shapes split over `count` devices: each must get whole envs, minibatches and reset worlds
        (also run for --devices all once the device count is known)."""
        if count == 1:
            return
        check(self.num_envs % count == 0, "devices", f"num_envs={self.num_envs} must split evenly over {count} devices")
        n = self.num_envs // count
        check(n * self.num_steps % self.num_minibatches == 0, "num_minibatches",
              f"each of {count} devices' {n} envs × {self.num_steps} steps must split into {self.num_minibatches} minibatches")
        check(self.policy != "rnn" or n % self.num_minibatches == 0, "num_minibatches",
              f"--policy rnn: {self.num_minibatches} minibatches must divide each device's {n} envs")
        r = min(self.optimistic_reset_ratio, n)
        check(n % r == 0, "optimistic_reset_ratio",
              f"{self.optimistic_reset_ratio} must divide each device's {n} envs (--devices {count})")
    def run_label(self) -> str:
        seeds = f"{self.seed}-{self.seed + self.num_seeds - 1}" if self.num_seeds > 1 else f"{self.seed}"
        return f"{self.env_name}{'-rnn' if self.policy == 'rnn' else ''}-s{seeds}"

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.total_timesteps // self.batch_size

    @property
    def reset_ratio(self) -> int:
        return min(self.optimistic_reset_ratio, self.num_envs)

    @property
    def chunk_updates(self) -> int:
        """Largest divisor of num_updates that is <= updates_per_chunk (fixed chunk size = one compile)."""
        k = min(self.updates_per_chunk, self.num_updates)
        while self.num_updates % k:
            k -= 1
        return k

    def hyper(self):
        from thinkcraft.rl.ppo import PPOHyper

        return PPOHyper(self.gamma, self.gae_lambda, self.clip_eps, self.ent_coef, self.vf_coef,
                        self.update_epochs, self.num_minibatches)

    @property
    def matmul_dtype(self):
        """`compute_dtype` as the jnp dtype the networks compute in."""
        import jax.numpy as jnp

        return jnp.bfloat16 if self.compute_dtype == "bfloat16" else jnp.float32


# Each caller builds what it uses (ppo-hidden its own network, eval no optimizer); `build` is all three.
def build_env(cfg: PPOConfig, num_envs: int | None = None):
    """The batched Craftax env of a config (`unroll_env_scans` resolved by make_env); `num_envs`: one env
    shard's (--devices), with the reset ratio capped by it as the config's is by num_envs."""
    from thinkcraft.envs.craftax import make_env

    n = cfg.num_envs if num_envs is None else num_envs
    return make_env(cfg.env_name, n, min(cfg.optimistic_reset_ratio, n), unroll_env_scans=cfg.unroll_env_scans)


def build_network(cfg: PPOConfig, env):
    """Plain PPO's actor-critic for `env`'s actions: the MLP, or with --policy rnn the GRU one."""
    from thinkcraft.rl.networks import ActorCritic, ActorCriticRNN

    if cfg.policy == "rnn":
        return ActorCriticRNN(env.num_actions, cfg.layer_width, dtype=cfg.matmul_dtype)
    return ActorCritic(env.num_actions, cfg.layer_width, dtype=cfg.matmul_dtype)


def initial_memory(cfg: PPOConfig, num_envs: int | None = None):
    """The policy's initial per-env memory (rl.ppo.Memory) for --policy rnn (of `num_envs`, default all);
    None for the MLP."""
    from thinkcraft.rl.ppo import initial_memory as zeros

    return zeros(cfg.num_envs if num_envs is None else num_envs, cfg.layer_width) if cfg.policy == "rnn" else None


def make_env_shards(cfg: PPOConfig, session: Any = None):
    """The run's env shards (rl/shards.py) from --devices, after jax.distributed when multi-host; checked
    against the shapes and, resuming, against the checkpoint's layout."""
    from thinkcraft.rl.shards import initialize_distributed, make_shards

    if cfg.coordinator_address is not None:
        initialize_distributed(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
    shards = make_shards(cfg.devices)
    cfg.check_devices(shards.count)
    if session is not None:
        saved = session.saved_derived.get("env_shards", 1) if session.resuming else shards.count
        if saved != shards.count:
            raise UserError(f"the checkpoint splits the envs over {saved} device(s), this run over {shards.count}: "
                            f"resume with --devices {saved}")
    return shards


def build_optimizer(cfg: PPOConfig):
    """Adam with gradient clipping and the config's lr schedule over its num_updates."""
    from thinkcraft.rl.ppo import make_optimizer

    return make_optimizer(cfg.lr, cfg.anneal_lr, cfg.max_grad_norm, cfg.num_updates, cfg.hyper())


def build(cfg: PPOConfig):
    """Env, network and optimizer of a plain-PPO config (shared by train, resume and the benchmarks)."""
    env = build_env(cfg)
    return env, build_network(cfg, env), build_optimizer(cfg)


def episode_metrics(m: dict[str, Any], achievement_names: tuple[str, ...], max_return: float) -> dict[str, float]:
    """Turn a chunk's episode sums into means (NaN-free: absent when no episode ended in the chunk)."""
    out: dict[str, float] = {"episode/count": float(m["_episodes"])}
    n = float(m["_episodes"])
    if n > 0:
        out["episode/return"] = float(m["_return_sum"]) / n
        out["episode/length"] = float(m["_length_sum"]) / n
        out["episode/return_pct_max"] = 100.0 * out["episode/return"] / max_return
        rates = np.asarray(m["_achievement_counts"]) / n
        for name, r in zip(achievement_names, rates):
            out[f"achievements/{name}"] = float(r)
        out["achievements/mean_rate"] = float(rates.mean())
    return out


def run(cfg: PPOConfig) -> dict[str, Any]:
    import jax
    from flax.training.train_state import TrainState

    from thinkcraft.envs.craftax import achievement_names, achievement_weights
    from thinkcraft.rl.ppo import RUNNER_AXES, init_runner_state, init_sharded_runner, make_train_chunk
    from thinkcraft.rl.seeds import init_seeds, over_seeds, seeds_template, split_seeds
    from thinkcraft.rl.shards import over_shards
    from thinkcraft.train.session import TrainSession
    from thinkcraft.utils.jaxcache import enable_compilation_cache
    from thinkcraft.utils.program_cache import compile_cached, program_key_config
    from thinkcraft.utils.progress import console, fmt_value

    session = TrainSession(cfg, "ppo", shape_fields=SHAPE_FIELDS, defaults=PPOConfig(),
                           total_steps=lambda c: c.num_updates * c.batch_size, title=lambda c: f"PPO {c.env_name}")
    cfg = session.cfg
    enable_compilation_cache()
    with session:
        # 1. build and initialise (or restore): each seed by the same jitted init (rl/seeds.py); with
        # --devices D each device's shard of the envs (rl/shards.py)
        shards = make_env_shards(cfg, session)
        D, n = shards.count, shards.local(cfg.num_envs)
        env = build_env(cfg, n)
        network, tx = build_network(cfg, env), build_optimizer(cfg)
        init = jax.jit(lambda rng: init_runner_state(env, network, tx, rng, memory=initial_memory(cfg)) if D == 1
                       else init_sharded_runner(env, network, tx, rng, D, memory=initial_memory(cfg, n)))
        S = cfg.num_seeds
        key_extra = program_key_config(cfg, PROGRAM_KEY_EXCLUDE)
        if not session.resuming:  # a traced init from the program cache (a resumed run restores its state)
            init = compile_cached(init, (jax.random.PRNGKey(cfg.seed),), name="ppo-init", key_extra=key_extra,
                                  static_aux={TrainState: (network.apply, tx)})
        runner = (session.restore(seeds_template(init, cfg.seed, S)) if session.resuming
                  else init_seeds(init, cfg.seed, S))
        runner = shards.place(runner, RUNNER_AXES, S)
        start_update = int(np.asarray(runner.update).reshape(-1)[0])
        session.save_config(num_updates=cfg.num_updates, chunk_updates=cfg.chunk_updates, batch_size=cfg.batch_size,
                            **({"env_shards": D} if D > 1 else {}))

        K = cfg.chunk_updates
        shard_chunk = over_shards(make_train_chunk(env, network.apply, cfg.num_steps, cfg.hyper(), K, shards.axis_name),
                                  shards, (RUNNER_AXES,), (RUNNER_AXES, None))
        chunk = jax.jit(over_seeds(shard_chunk, S), donate_argnums=0)
        names = achievement_names(cfg.env_name)
        max_return = float(sum(achievement_weights(cfg.env_name)))

        # 2. compile once (AOT, timed apart from the steady-state SPS)
        t0 = time.perf_counter()
        compiled = compile_cached(chunk, (runner,), name="ppo-chunk", donate_argnums=(0,), key_extra=key_extra)
        compile_s = time.perf_counter() - t0
        seeds = (f" × {S} seeds" if S > 1 else "") + (f" over {D} devices" if D > 1 else "")
        console.print(f"compiled a chunk of {K} update(s) × {cfg.batch_size:,} steps{seeds} in {compile_s:.1f} s",
                      soft_wrap=True)
        session.summary["compile_s"] = compile_s

        # 3. chunks: one device call each (runner donated), one host sync for the metrics
        end_update = cfg.num_updates
        if cfg.stop_after_updates:
            end_update = min(end_update, start_update + cfg.stop_after_updates)
        update = start_update
        session.start(update)
        while session.running(update, end_update):
            t0 = time.perf_counter()
            runner, m = compiled(runner)
            m = jax.device_get(m)
            chunk_s = time.perf_counter() - t0
            update += K
            sps = S * K * cfg.batch_size / chunk_s
            timing = {"sps": sps, "timing/chunk_s": chunk_s,
                      "timing/compile_s": compile_s if update == start_update + K else None}
            if S > 1:
                timing["sps_per_seed"] = sps / S
            recs = [chunk_record(mi, names, max_return) | timing for mi in split_seeds(m, S)]
            ret = float(np.nanmean([r.get("episode/return", np.nan) for r in recs])) if any(
                "episode/return" in r for r in recs) else float("nan")
            session.log_seeds(update, update * cfg.batch_size, recs, sps=sps, ret=ret)
            _checkpoint(session, update, update * cfg.batch_size, runner)
        _checkpoint(session, update, update * cfg.batch_size, runner, force=True)
        summary = session.summary
        summary.update({"update": update, "env_steps": update * cfg.batch_size})
        console.print(
            f"done: {update:,}/{cfg.num_updates:,} updates, {update * cfg.batch_size:,} steps{seeds}; "
            f"return {fmt_value(summary.get('episode/return', float('nan')))}{' (mean over seeds)' if S > 1 else ''}; "
            f"sps {summary.get('sps', 0):,.0f}; run dir {session.run_dir}", soft_wrap=True)
    return summary


def _checkpoint(session: Any, update: int, env_steps: int, runner: Any, force: bool = False) -> None:
    """session.maybe_checkpoint, the state first gathered to this host when it spans several (multi-host:
    every process takes process 0's decision, since the gather is collective)."""
    from thinkcraft.rl.shards import agree, gather_to_host

    if agree(session.checkpoint_due(update, force)):
        state = gather_to_host(runner)
        session.save_checkpoint(update, env_steps, state, state.train_state.params)


def chunk_record(m: dict[str, Any], names: tuple[str, ...], max_return: float) -> dict[str, Any]:
    """One seed's metrics of a chunk (host values): loss means and episode means."""
    rec = {k: float(v) for k, v in m.items() if not k.startswith("_")}
    rec.update(episode_metrics(m, names, max_return))
    return rec
