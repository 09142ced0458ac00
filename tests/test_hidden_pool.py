"""ppo-hidden's reset pool (rl/hidden.py): an env that resets inside a window acts on its new world's hidden
state. Pure pieces first (the pool walk, the aux update, the overlapped schedule with fakes), then the real
kernels on tiny Craftax-Classic with a tiny random LLM (slow: they compile the window's scan)."""

from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from thinkcraft.envs.craftax import pool_world_index
from thinkcraft.rl.hidden import HiddenAux, RunningNorm, aux_after_step, refresh


def test_pool_walk_takes_consecutive_worlds_and_wraps():
    done = jnp.array([False, True, True, False, True])
    np.testing.assert_array_equal(np.asarray(pool_world_index(done, jnp.int32(0), 4)), [0, 0, 1, 0, 2])
    # the walk continues from the cursor and wraps around the pool (shared worlds beyond P resets)
    np.testing.assert_array_equal(np.asarray(pool_world_index(done, jnp.int32(3), 4)), [0, 3, 0, 0, 1])
    np.testing.assert_array_equal(np.asarray(pool_world_index(jnp.zeros(5, bool), jnp.int32(2), 4)), [0] * 5)


def test_a_reset_env_takes_its_pool_worlds_hidden_state_at_age_zero():
    pool_h = jnp.arange(3 * 2, dtype=jnp.float32).reshape(3, 2) + 100
    aux = HiddenAux(jnp.zeros((4, 2)), jnp.array([5, 5, 5, 5]), jnp.array([True, True, False, True]), pool_h)
    done = jnp.array([False, True, False, True])
    took = jnp.array([-1, 2, -1, 0])
    out = aux_after_step(aux, done, NS(took=took))
    np.testing.assert_array_equal(np.asarray(out.hidden), [[0, 0], [104, 105], [0, 0], [100, 101]])
    np.testing.assert_array_equal(np.asarray(out.age), [6, 0, 6, 0])
    np.testing.assert_array_equal(np.asarray(out.valid), [True, True, False, True])
    # without a pool (the masked scheme) the same step masks the reset envs
    masked = aux_after_step(aux._replace(pool_hidden=None), done, NS(took=took))
    np.testing.assert_array_equal(np.asarray(masked.valid), [True, False, False, False])
    np.testing.assert_array_equal(np.asarray(masked.age), [6, 6, 6, 6])


def test_refresh_normalises_the_pool_with_the_envs():
    rng = np.random.default_rng(0)
    h, ph = rng.normal(size=(6, 3)).astype(np.float32), rng.normal(2.0, 3.0, size=(2, 3)).astype(np.float32)
    norm, aux = refresh(RunningNorm.create(3), jnp.asarray(h), jnp.zeros(6, jnp.int32), jnp.ones(6, bool), jnp.asarray(ph))
    both = np.concatenate([h, ph])
    assert float(norm.count) == 8
    np.testing.assert_allclose(np.asarray(aux.pool_hidden), (ph - both.mean(0)) / np.sqrt(both.var(0) + 1e-8), rtol=1e-4)


class _Src:
    """Fake source: a 'state' is a tuple of item names; texts concatenates them; hidden returns them."""

    def __init__(self):
        from thinkcraft.utils.timing import PhaseTimer

        self.timer = PhaseTimer()

    def texts(self, *states):  # the envs' (wrapped, as extract accepts them), then the pools'
        return [x for s in states for x in getattr(s, "env_state", s)]

    def hidden(self, texts):
        from thinkcraft.train.ppo_hidden.source import FreshHidden

        return FreshHidden(np.array(texts, dtype=object), 1.0)


def test_overlapped_schedule_installs_the_pool_encoded_at_the_previous_snapshot():
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig
    from thinkcraft.train.ppo_hidden.schedule import OverlappedRefresh

    pools = iter(range(100))
    installs = []

    def new_pool(state):  # overlap: the pending pool becomes current, a fresh one is made
        k = next(pools)
        return NS(runner=NS(rollout=NS(env_state=NS(env_state=state.runner.rollout.env_state.env_state,
                                                    pool=state.next_pool))),
                  next_pool=NS(env_state=(f"p{k}a", f"p{k}b")), done_since_snapshot=state.done_since_snapshot)

    def install(state, hidden, age, valid, pool_hidden, keep):
        installs.append((list(hidden), int(age), np.asarray(valid).tolist(), list(pool_hidden), np.asarray(keep).tolist()))
        return state

    def state(snap, done, next_pool=None):
        return NS(runner=NS(rollout=NS(env_state=NS(env_state=snap, pool=None))),
                  next_pool=next_pool or NS(env_state=("init-a", "init-b")), done_since_snapshot=jnp.asarray(done))

    cfg = PPOHiddenConfig(num_envs=2, num_steps=16, skip_n=8, overlap=True, overlap_env_sms=0, reset_pool_size=2)
    assert cfg.pool_size == 2
    with OverlappedRefresh(cfg, _Src(), NS(new_pool=new_pool, install=install), engine=None) as sch:
        # the first refresh is synchronous: this snapshot at age 0 and the current pool, encoded with the next one
        sch.before_window(state(("a0", "a1"), [False, False]), 0)
        assert installs[-1] == (["a0", "a1"], 0, [True, True], ["init-a", "init-b"], [False, False])
        # later: the previous snapshot one interval old; the pool encoded with it; every env valid, and the env
        # whose episode ended since the snapshot keeps the pool world's hidden state it reset into
        sch.before_window(state(("b0", "b1"), [False, True], NS(env_state=("p0a", "p0b"))), 0)
        assert installs[-1] == (["a0", "a1"], 8, [True, True], ["p0a", "p0b"], [False, True])
        sch.before_window(state(("c0", "c1"), [True, False], NS(env_state=("p1a", "p1b"))), 1)
        assert installs[-1] == (["b0", "b1"], 8, [True, True], ["p1a", "p1b"], [True, False])
    assert sch.pop_suffix_tokens() == [1.0, 1.0, 1.0]


def test_pool_size_defaults_and_checks(capsys):
    from thinkcraft.cli import main
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig

    assert PPOHiddenConfig(num_envs=128).pool_size == 8  # num_envs / optimistic_reset_ratio
    assert PPOHiddenConfig(num_envs=128, reset_pool_size=0).pool_size == 0
    assert main(["train", "ppo-hidden", "--reset-pool-size", "-1"]) == 2
    assert "--reset-pool-size: must be >= 0" in capsys.readouterr().err


# --- the real kernels: tiny Craftax-Classic, tiny random LLM ------------------------------------------------

N, T, P = 4, 8, 2


def _setup(overlap: bool, max_timesteps: int):
    import dataclasses

    from thinkcraft.envs.craftax import make_env
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.testing import tiny_llama
    from thinkcraft.train.ppo import build_optimizer
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig
    from thinkcraft.train.ppo_hidden.kernels import build_kernels, build_network, make_init
    from thinkcraft.train.ppo_hidden.source import HiddenStateSource
    from thinkcraft.utils.timing import PhaseTimer

    cfg = PPOHiddenConfig(env_name="craftax-classic", num_envs=N, num_steps=T, skip_n=T, layer_width=32,
                          hidden_proj_dim=8, num_minibatches=2, total_timesteps=4 * N * T, reset_pool_size=P,
                          overlap=overlap, overlap_env_sms=0, unroll_env_scans="off")
    env = make_env(cfg.env_name, N, 1)
    env = dataclasses.replace(env, params=env.params.replace(max_timesteps=max_timesteps))  # episodes end soon
    engine = HFEngine.from_model(*tiny_llama())
    net = build_network(cfg, env)
    init = make_init(cfg, env, net, build_optimizer(cfg), engine.hidden_size)
    src = HiddenStateSource(engine, cfg, "craftax-classic", PhaseTimer())
    return cfg, env, engine, init, build_kernels(cfg, env, net), src


def _stagger(state, timesteps):
    """Start the envs at different timesteps: their episodes end at different steps of the window."""
    es = state.runner.rollout.env_state
    core = es.env_state.env_state.replace(timestep=jnp.asarray(timesteps, jnp.int32))
    es = es.replace(env_state=es.env_state.replace(env_state=core))
    return state._replace(runner=state.runner._replace(rollout=state.runner.rollout._replace(env_state=es)))


def _direct_encode(cfg, engine, craftax_states, norm):
    """The normalised hidden states of rendering the states and calling the engine on the texts."""
    from thinkcraft.envs.text import extract, render
    from thinkcraft.llm.protocol import Batch
    from thinkcraft.train.ppo_hidden.config import make_prompt_prefix

    texts = render(jax.device_get(extract(craftax_states)), fmt="compact", env_kind="craftax-classic")
    h = engine.hidden_states(Batch(texts, prefix=make_prompt_prefix(cfg)), cfg.layer, cfg.pooling)
    return np.asarray(norm.normalize(jnp.asarray(h)))


def _walk(done, cursor=0):
    """(step, env) -> pool world, recomputed: the done envs of a step, in index order, take the next worlds."""
    out = {}
    for t in range(done.shape[0]):
        for i in np.nonzero(done[t])[0]:
            out[(t, int(i))] = cursor % P
            cursor += 1
    return out


@pytest.mark.slow
def test_sync_reset_envs_act_on_the_pool_worlds_state_and_hidden_state():
    from thinkcraft.train.ppo_hidden.schedule import SyncRefresh

    cfg, env, engine, init, kernels, src = _setup(overlap=False, max_timesteps=T)

    def one_window(seed):
        state = _stagger(jax.jit(init)(jax.random.PRNGKey(seed)), [0, T - 3, T - 2, T - 1])
        state, fresh = SyncRefresh(cfg, src, kernels).before_window(state, 0)
        return kernels.window_after_refresh(state, fresh), state.runner.rollout.env_state.pool

    (state, traj, _, info), pool = one_window(0)
    done = np.asarray(traj.done)
    walk = _walk(done)
    assert len(walk) > P, "more resets than pool worlds: the walk must wrap (shared worlds)"
    assert float(info["valid"]) == 1.0 and bool(np.asarray(traj.obs.valid).all())
    want_h = _direct_encode(cfg, engine, pool.env_state, state.norm)
    obs, hid, age = np.asarray(traj.obs.obs), np.asarray(traj.obs.hidden), np.asarray(traj.obs.age)
    for (t, i), w in walk.items():
        if t + 1 < T:  # the next step acts on the pool world's first observation and its hidden state
            np.testing.assert_array_equal(obs[t + 1, i], np.asarray(pool.obs[w]))
            np.testing.assert_allclose(hid[t + 1, i], want_h[w], rtol=1e-4, atol=1e-4)
            assert age[t + 1, i] == 0
    # an env that reset at the last step holds exactly the pool world's state
    last = [i for (t, i) in walk if t == T - 1]
    assert last, "the staggered start makes env 0 reset at the window's last step"
    got = jax.tree.map(lambda x: np.asarray(x[last[0]]), state.runner.rollout.env_state.env_state.env_state)
    want = jax.tree.map(lambda x: np.asarray(x[walk[(T - 1, last[0])]]), pool.env_state)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    assert int(state.runner.rollout.env_state.pool.cursor) == len(walk)
    # a window without a refresh (skip_n > num_steps): the resets walk on through the same pool
    state_b, traj_b, _, info_b = kernels.window(state)
    walk_b = _walk(np.asarray(traj_b.done), cursor=len(walk))
    assert walk_b and float(info_b["valid"]) == 1.0
    for (t, i), w in walk_b.items():
        if t + 1 < T:
            np.testing.assert_array_equal(np.asarray(traj_b.obs.obs)[t + 1, i], np.asarray(pool.obs[w]))
            np.testing.assert_allclose(np.asarray(traj_b.obs.hidden)[t + 1, i], want_h[w], rtol=1e-4, atol=1e-4)
    assert int(state_b.runner.rollout.env_state.pool.cursor) == len(walk) + len(walk_b)
    # the pool and its walk are deterministic given the rng; another seed draws other worlds
    (state2, traj2, _, _), pool2 = one_window(0)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(pool), jax.tree.leaves(pool2)))
    np.testing.assert_array_equal(np.asarray(traj2.done), done)
    np.testing.assert_array_equal(np.asarray(traj2.obs.obs), obs)
    _, pool3 = one_window(1)
    assert not np.array_equal(np.asarray(pool3.obs), np.asarray(pool.obs))


@pytest.mark.slow
def test_overlap_reset_envs_act_on_the_pool_encoded_at_the_previous_snapshot():
    from thinkcraft.train.ppo_hidden.schedule import OverlappedRefresh

    cfg, env, engine, init, kernels, src = _setup(overlap=True, max_timesteps=2 * T)
    # episodes of 2T steps: envs 1-3 end early in windows 0 and 2, env 0 at the last step of window 1
    state = _stagger(jax.jit(init)(jax.random.PRNGKey(2)), [0, 2 * T - 3, 2 * T - 2, 2 * T - 1])
    windows = []
    with OverlappedRefresh(cfg, src, kernels, engine) as sch:
        for k in range(3):
            # the pool this interval uses is the one made (and encoded) at the previous refresh point
            state, _ = sch.before_window(state, k)
            pool, norm = jax.device_get((state.runner.rollout.env_state.pool, state.norm))
            state, traj, _, info = kernels.window(state)
            if sch._future is not None:  # the engine is not thread-safe: the worker's call first, then ours
                sch._future.result()
            want_h = _direct_encode(cfg, engine, pool.env_state, norm)
            windows.append((jax.device_get(traj), want_h, float(info["valid"])))
            state, _ = kernels.update(state, (traj,))  # (donates the state)
    for k, (traj, want_h, valid) in enumerate(windows):
        assert valid == 1.0, f"window {k}: every hidden input valid"
        hid, age = np.asarray(traj.obs.hidden), np.asarray(traj.obs.age) * cfg.skip_n
        walk = _walk(np.asarray(traj.done))
        assert walk, f"window {k} has resets"
        for (t, i), w in walk.items():
            if t + 1 < T:
                np.testing.assert_allclose(hid[t + 1, i], want_h[w], rtol=1e-4, atol=1e-4)
                assert age[t + 1, i] == 0
        if k:  # an env that reset in the previous window keeps that pool world's hidden state, age going on;
            # the others take the previous snapshot's, one interval old
            prev, prev_h, _ = windows[k - 1]
            last = {i: (t, w) for (t, i), w in sorted(_walk(np.asarray(prev.done)).items())}
            assert last and len(last) < N
            for i in range(N):
                if i in last:
                    t, w = last[i]
                    np.testing.assert_allclose(hid[0, i], prev_h[w], rtol=1e-4, atol=1e-4)
                    assert age[0, i] == pytest.approx(T - 1 - t)  # age 0 at step t + 1
                else:
                    assert age[0, i] == pytest.approx(cfg.skip_n)
