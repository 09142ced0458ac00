"""ppo-hidden's state and its jitted kernels (shared with plain PPO: make_rollout, ppo_update).

    new_pool(state)                         a refresh point's reset pool (rl/hidden.py; not with pool size 0)
    install(state, hidden, age, valid, pool_hidden, keep)
                                            a refresh: running-stat update + z-normalisation (rl.hidden)
    window(state)                           lax.scan of window_steps env+policy steps
    window_after_refresh(state, hidden)     install (age 0, every env valid) and the window, one call
    update(state, trajs, memory)            GAE + PPO update over the windows' trajectories (state donated);
                                            `memory`: --policy rnn's memory at the update's first window

With --num-seeds K every kernel is vmapped over a leading seed axis of the state and of the hidden states
(rl/seeds.py); K = 1 compiles the unvmapped kernels. With --devices D (rl/shards.py) every kernel is written
for one env shard (n = N / D envs, p = P / D pool worlds) and run over all of them (`over_shards`): the
per-env state carries a shard axis (`state_axes`), a refresh's hidden states (N [+ P], H) are replicated on
every device and each shard takes its rows (the running statistics are updated over all of them, as on
one device), the update averages gradients over the shards. D = 1 compiles exactly the unsharded kernels.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from thinkcraft.train.ppo_hidden.config import PPOHiddenConfig


class HiddenRunner(NamedTuple):
    """Everything ppo-hidden carries from one update to the next (what a checkpoint holds)."""

    runner: Any  # rl.ppo.RunnerState (its rollout.aux is an rl.hidden.HiddenAux; with a reset pool its
    # rollout.env_state is an envs.craftax.PooledState)
    norm: Any  # rl.hidden.RunningNorm
    done_since_snapshot: Any  # (N,) bool, for --overlap: episodes ended since the pending snapshot
    next_pool: Any = None  # --overlap with a reset pool: the next interval's pool (encoded by the worker)


class Kernels(NamedTuple):
    new_pool: Callable[[HiddenRunner], HiddenRunner]
    install: Callable[..., HiddenRunner]
    window: Callable[[HiddenRunner], tuple]
    window_after_refresh: Callable[[HiddenRunner, Any], tuple]
    update: Callable[[HiddenRunner, tuple], tuple[HiddenRunner, dict]]


def build_network(cfg: PPOHiddenConfig, env: Any) -> Any:
    """The actor-critic that also reads the (projected) hidden state, its age and validity: the MLP, or with
    --policy rnn the GRU one (the same features feed its embedding)."""
    from thinkcraft.rl.networks import ActorCriticAug, ActorCriticRNN

    if cfg.policy == "rnn":
        return ActorCriticRNN(env.num_actions, cfg.layer_width, hidden_proj_dim=cfg.hidden_proj_dim,
                              dtype=cfg.matmul_dtype)
    return ActorCriticAug(env.num_actions, cfg.layer_width, hidden_proj_dim=cfg.hidden_proj_dim,
                          dtype=cfg.matmul_dtype)


def state_axes() -> HiddenRunner:
    """`over_shards` axes of a HiddenRunner: per-env leaves (and the pools) split, the rest replicated."""
    from thinkcraft.rl.ppo import RUNNER_AXES

    return HiddenRunner(runner=RUNNER_AXES, norm=None, done_since_snapshot=0, next_pool=0)


def make_init(cfg: PPOHiddenConfig, env: Any, network: Any, tx: Any, hidden_size: int,
              shards: Any = None) -> Callable[[Any], HiddenRunner]:
    """Pure `init(rng) -> HiddenRunner` (jax.eval_shape of it is the checkpoint template). `env` is one env
    shard's with --devices (`shards`): the per-env state then has a leading shard axis."""
    import jax
    import jax.numpy as jnp

    from thinkcraft.rl.hidden import AugInput, RunningNorm, empty_aux
    from thinkcraft.rl.ppo import init_runner_state, init_sharded_runner
    from thinkcraft.train.ppo import initial_memory

    D = 1 if shards is None else shards.count
    N, H, P = cfg.num_envs // D, hidden_size, cfg.pool_size // D  # one shard's
    sample = AugInput(jnp.zeros((1, env.obs_dim)), jnp.zeros((1, H)), jnp.zeros((1,)), jnp.zeros((1,)))

    def over(fn: Callable, key: Any) -> Any:  # one pool per shard, each from its own key
        return fn(key) if D == 1 else jax.vmap(fn)(jax.random.split(key, D))

    def init(rng: Any) -> HiddenRunner:
        if D == 1:
            runner = init_runner_state(env, network, tx, rng, aux=empty_aux(N, H, P), sample_input=sample,
                                       memory=initial_memory(cfg))
        else:
            runner = init_sharded_runner(env, network, tx, rng, D, aux=empty_aux(N, H, P), sample_input=sample,
                                         memory=initial_memory(cfg, N))
        next_pool = None
        if P:  # the pools of the first refresh point (its new_pool replaces the current one in sync mode)
            k_now, k_next = jax.random.split(jax.random.fold_in(rng, 1))
            rs = runner.rollout
            pool = over(lambda k: env.make_pool(k, P), k_now)
            with_pool = env.with_pool if D == 1 else jax.vmap(env.with_pool)
            runner = runner._replace(rollout=rs._replace(env_state=with_pool(rs.env_state, pool)))
            next_pool = over(lambda k: env.make_pool(k, P), k_next) if cfg.overlap else None
        done = jnp.zeros((N,), bool) if D == 1 else jnp.zeros((D, N), bool)
        return HiddenRunner(runner, RunningNorm.create(H), done, next_pool)

    return init


def build_kernels(cfg: PPOHiddenConfig, env: Any, network: Any, shards: Any = None) -> Kernels:
    """The jitted functions of the loop (compiled on first call: the fused refresh+window once). With
    `shards` (--devices) `env` is one shard's and each kernel runs over all shards (module doc). Longer than
    80 lines because the six kernels are closures over one set of shapes and helpers, defined side by side."""
    import jax
    import jax.numpy as jnp

    from thinkcraft.rl.hidden import aux_after_step, make_policy_input, refresh
    from thinkcraft.rl.ppo import make_rollout, policy_step, ppo_update
    from thinkcraft.rl.seeds import over_seeds
    from thinkcraft.rl.shards import EnvShards, over_shards, shard_rows

    shards = shards or EnvShards(1)
    axis, D = shards.axis_name, shards.count
    N_all, P_all, S = cfg.num_envs, cfg.pool_size, cfg.num_seeds
    N, P = N_all // D, P_all // D  # one shard's envs and pool worlds (all of them when D = 1)

    def rows(hidden: jax.Array, pool_hidden: jax.Array | None) -> tuple:
        """This shard's rows of a refresh's hidden states, which every shard holds whole."""
        return shard_rows(hidden, N, axis), None if pool_hidden is None else shard_rows(pool_hidden, P, axis)
    policy_input = make_policy_input(float(cfg.skip_n))
    rollout = make_rollout(env, network.apply, cfg.window_steps, policy_input, aux_after_step)
    hp = cfg.hyper()

    def _new_pool(state: HiddenRunner) -> HiddenRunner:
        """Sync: a fresh pool for the coming interval. Overlap: the pool made at the previous refresh point
        (encoded by its worker call) becomes current; a fresh one is made for the next interval."""
        r = state.runner
        rng, k = jax.random.split(r.rollout.rng)
        fresh = env.make_pool(k, P)
        current, nxt = (state.next_pool, fresh) if cfg.overlap else (fresh, None)
        env_state = env.with_pool(r.rollout.env_state.env_state, current)
        r = r._replace(rollout=r.rollout._replace(env_state=env_state, rng=rng))
        return state._replace(runner=r, next_pool=nxt)

    def _install(state: HiddenRunner, hidden: jax.Array, age: jax.Array, valid: jax.Array,
                 pool_hidden: jax.Array | None = None, keep: jax.Array | None = None) -> HiddenRunner:
        """New hidden states (N, H) at `age`, valid where `valid`; the current pool's (P, H); envs where
        `keep` keep the hidden input they have (overlap: they reset into a pool world since the snapshot)."""
        r = state.runner
        old = r.rollout.aux
        norm, aux = refresh(state.norm, hidden, jnp.full((N,), age, jnp.int32), valid, pool_hidden,
                            rows if D > 1 else None)
        if keep is not None:
            aux = aux._replace(hidden=jnp.where(keep[:, None], old.hidden, aux.hidden),
                               age=jnp.where(keep, old.age, aux.age), valid=jnp.where(keep, old.valid, aux.valid))
        return HiddenRunner(r._replace(rollout=r.rollout._replace(aux=aux)), norm, jnp.zeros((N,), bool),
                            state.next_pool)

    def _window(state: HiddenRunner):
        r = state.runner
        rs, traj, stats = rollout(r.train_state.params, r.rollout)
        info = {"age": traj.obs.age.mean() * cfg.skip_n, "valid": traj.obs.valid.mean()}
        if D > 1:  # all shards' (equal shares)
            stats, info = jax.lax.psum(stats, axis), jax.lax.pmean(info, axis)
        done_any = state.done_since_snapshot | traj.done.any(0)
        return state._replace(runner=r._replace(rollout=rs), done_since_snapshot=done_any), traj, stats, info

    # Synchronous refresh: install (age 0, every env valid) and the window in one jitted call (one dispatch
    # of the big runner state instead of two; on an H100 at skip_n=1 no measurable SPS change). The window
    # alone is compiled only when some windows have no refresh (skip_n > num_steps). `hidden` holds the
    # envs' N rows, then the reset pool's P (with --devices: all shards' rows; install takes this shard's).
    def window_after_refresh(state: HiddenRunner, hidden: jax.Array):
        pool_hidden = hidden[N_all:] if P else None
        return _window(_install(state, hidden[:N_all], 0, jnp.ones((N,), bool), pool_hidden))

    def _update(state: HiddenRunner, trajs: tuple, memory: Any = None):
        r = state.runner
        traj = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *trajs)
        ts = r.train_state
        x = policy_input(r.rollout.obs, r.rollout.aux)
        _, _, last_value = policy_step(network.apply, ts.params, x, r.rollout.memory)
        rng, k = jax.random.split(r.rollout.rng)
        ts, metrics = ppo_update(ts, traj, last_value, k, hp, memory, axis)
        r = r._replace(train_state=ts, rollout=r.rollout._replace(rng=rng), update=r.update + 1)
        return state._replace(runner=r), metrics

    # over the shards (identity for one): the per-env state split, a refresh's hidden states and the age
    # replicated, the window's stats and info reduced in it; then over the seeds (the age of an install is
    # one number for every seed)
    st = state_axes()
    window_out = (st, 0, None, None)
    new_pool = over_shards(_new_pool, shards, (st,), st)
    install = over_shards(_install, shards, (st, None, None, 0, None, 0), st)
    window = over_shards(_window, shards, (st,), window_out)
    window_after_refresh = over_shards(window_after_refresh, shards, (st, None), window_out)
    update = over_shards(_update, shards, (st, 0, 0), (st, None))
    # the kernels that trace env steps or the PPO update come from the traced-program cache on a re-run
    # (utils/program_cache.py: no tracing or lowering, so a resumed run starts sooner); `install` is cheap
    cached = _program_cache(cfg)
    return Kernels(new_pool=cached(jax.jit(over_seeds(new_pool, S)), "ppo-hidden-pool"),
                   install=jax.jit(over_seeds(install, S, in_axes=(0, 0, None, 0, 0, 0))),
                   window=cached(jax.jit(over_seeds(window, S)), "ppo-hidden-window"),
                   window_after_refresh=cached(jax.jit(over_seeds(window_after_refresh, S)), "ppo-hidden-refresh-window"),
                   update=cached(jax.jit(over_seeds(update, S), donate_argnums=0), "ppo-hidden-update", (0,)))


def _program_cache(cfg: PPOHiddenConfig) -> Callable[..., Any]:
    """(jitted kernel, name[, donated args]) -> the kernel compiled through the program cache at its first call,
    keyed by every config field that can shape it (train ppo's run-only fields excluded). Every kernel takes
    the state, so an output's TrainState takes its apply_fn and optimizer from the argument's."""
    from thinkcraft.train.ppo import PROGRAM_KEY_EXCLUDE
    from thinkcraft.utils.program_cache import LazyCachedKernel, program_key_config

    key_extra = program_key_config(cfg, PROGRAM_KEY_EXCLUDE)

    def cached(jitted: Any, name: str, donate: tuple[int, ...] = ()) -> Any:
        return LazyCachedKernel(jitted, name=name, donate_argnums=donate, key_extra=key_extra)

    return cached
