"""envs/: the env-name table, the state unwrapper, the shared env-step scan, and the unrolled inner loops
(`unroll_env_scans`: same states, no loops left)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from thinkcraft.envs.craftax import (
    ENV_KINDS, ENV_NAMES, canonical_env_name, env_kind, make_env, symbolic_env_name, unwrap_env_state,
)
from thinkcraft.envs.scan import EnvCarry, make_env_scan, random_actions
from thinkcraft.envs.unroll import resolve_unroll_env_scans, unroll_env_scans
from thinkcraft.train.ppo import PPOConfig
from thinkcraft.utils.errors import UserError


def _rolled_loops(env) -> int:
    """Scans inside one traced env step whose iterations stay a loop (unroll < length), and whiles."""
    def step(rng, st):
        a = jnp.zeros((env.num_envs,), jnp.int32)
        return env.step(rng, st, a)[1]

    _, st = jax.eval_shape(env.reset, jax.random.PRNGKey(0))
    return _loops_in(jax.make_jaxpr(step)(jax.random.PRNGKey(0), st).jaxpr)


def _loops_in(jaxpr) -> int:
    """`_rolled_loops`'s count over a traced program."""
    n = 0

    def walk(j) -> None:
        nonlocal n
        for e in j.eqns:
            if e.primitive.name == "scan" and e.params["unroll"] < e.params["length"]:
                n += 1
            elif e.primitive.name == "while":
                n += 1
            for p in e.params.values():
                for s in p if isinstance(p, (list, tuple)) else [p]:
                    inner = getattr(s, "jaxpr", s)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr)
    return n


@pytest.mark.parametrize("setting,loops", [("on", False), ("off", True)])
def test_craftax_text_env_steps_unrolled_where_asked(setting, loops):
    # the llm-policy env (envs/textenvs/craftax.py): its compiled masked step, traced only (no compile)
    from thinkcraft.envs.textenvs import CraftaxTextConfig, CraftaxTextEnv

    env = CraftaxTextEnv(CraftaxTextConfig(env_kind="craftax-classic", unroll_env_scans=setting))
    assert env.unrolled is (setting == "on")
    seeds = jnp.arange(3, dtype=jnp.uint32)
    keys, st, _ = jax.eval_shape(env._reset, seeds)  # reset also gives the keys and the semantic arrays
    jaxpr = jax.make_jaxpr(env._advance)(keys, st, jnp.zeros(3, jnp.int32), jnp.zeros(3, bool)).jaxpr
    assert (_loops_in(jaxpr) > 10) is loops
    assert (_loops_in(jax.make_jaxpr(env._reset)(seeds).jaxpr) > 0) is loops  # world generation's
    assert jax.lax.scan.__module__.startswith("jax")  # the swap is undone after the trace


def test_craftax_text_env_refuses_a_bad_unroll_setting():
    from thinkcraft.envs.textenvs import CraftaxTextConfig, CraftaxTextEnv

    with pytest.raises(UserError, match="unroll_env_scans"):
        CraftaxTextEnv(CraftaxTextConfig(env_kind="craftax-classic", unroll_env_scans="yes"))


@pytest.mark.parametrize("name", ["Craftax-Classic-Symbolic-v1", pytest.param("Craftax-Symbolic-v1", marks=pytest.mark.slow)])
def test_unrolled_step_has_no_loops_left(name):
    # Tracing only (no compile). craftax's step holds short scans and jax.random.choice's binary searches
    assert _rolled_loops(make_env(name, 4, 2)) > 10
    assert _rolled_loops(make_env(name, 4, 2, unroll_env_scans=True)) == 0
    # the swap is undone after the trace
    assert jax.lax.scan.__module__.startswith("jax") and jnp.searchsorted.__module__.startswith("jax")


@pytest.mark.slow  # compiles a Craftax-Classic scan twice (rolled, unrolled)
def test_unrolled_env_gives_the_same_states_bit_for_bit():
    n, steps = 4, 6
    out = {}
    for unroll in (False, True):
        env = make_env("Craftax-Classic-Symbolic-v1", n, 2, unroll_env_scans=unroll)
        scan = make_env_scan(env, random_actions(env), steps, record=lambda s: (s.next_obs, s.reward, s.done))

        def run(rng, env=env, scan=scan):
            obs, st = env.reset(rng)
            return scan(EnvCarry(st, obs, rng))

        out[unroll] = jax.device_get(jax.jit(run)(jax.random.PRNGKey(3)))
    a, b = jax.tree.leaves(out[False]), jax.tree.leaves(out[True])
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_unroll_env_scans_disabled_is_a_no_op():
    before = jax.lax.scan
    with unroll_env_scans(False):
        assert jax.lax.scan is before
    with unroll_env_scans(True):
        assert jax.lax.scan is not before
    assert jax.lax.scan is before


def test_unroll_env_scans_auto_follows_the_backend():
    assert resolve_unroll_env_scans("auto") == (jax.default_backend() == "gpu")
    assert resolve_unroll_env_scans("on") is True and resolve_unroll_env_scans("off") is False
    assert resolve_unroll_env_scans(True) is True
    # the config's setting reaches the env (build_env -> make_env resolves it)
    from thinkcraft.train.ppo import build_env

    for setting, want in (("on", True), ("off", False), ("auto", jax.default_backend() == "gpu")):
        cfg = PPOConfig(env_name="craftax-classic", num_envs=4, total_timesteps=256, unroll_env_scans=setting)
        assert build_env(cfg).unroll_env_scans is want


def test_bad_unroll_env_scans_is_a_clear_error(capsys):
    from thinkcraft.cli import main
    from thinkcraft.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="--unroll-env-scans: auto, on or off"):
        PPOConfig(unroll_env_scans="maybe")
    assert main(["train", "ppo", "--unroll-env-scans", "maybe"]) == 2
    assert "unroll-env-scans" in capsys.readouterr().err


def test_one_env_name_table():
    assert canonical_env_name("craftax") == "Craftax-Symbolic-v1" == canonical_env_name("Craftax")
    assert canonical_env_name("classic") == "Craftax-Classic-Symbolic-v1"
    for name in ENV_NAMES:
        assert canonical_env_name(name) == name
        assert env_kind(name) == ("craftax-classic" if "Classic" in name else "craftax")
    for kind in ENV_KINDS:  # a kind is its game's symbolic env
        assert env_kind(kind) == kind and env_kind(symbolic_env_name(kind)) == kind
    assert symbolic_env_name("Craftax-Classic-Pixels-v1") == "Craftax-Classic-Symbolic-v1"
    with pytest.raises(UserError, match="valid names: Craftax-Symbolic-v1"):
        env_kind("minecraft")


def test_one_state_unwrapper_finds_the_craftax_state_inside_wrappers():
    from craftax.craftax_classic.envs.craftax_state import EnvState
    from flax import struct

    env = make_env("Craftax-Classic-Symbolic-v1", 2, 1)
    _, st = jax.eval_shape(env.reset, jax.random.PRNGKey(0))  # tracing only

    @struct.dataclass
    class Outer:  # like LogWrapper: the env state sits in .env_state
        env_state: object

    assert isinstance(unwrap_env_state(Outer(st)), EnvState) and unwrap_env_state(st) is st.env_state
    assert unwrap_env_state(st.env_state) is st.env_state


class _CountingEnv:
    """A stand-in for VecEnv: state counts steps, obs = state, reward = action, never done."""

    num_envs, num_actions = 3, 5

    def step(self, rng, state, action):
        state = state + 1
        obs = state[:, None].astype(jnp.float32)
        done = jnp.zeros_like(state, bool)
        return obs, state, action.astype(jnp.float32), done, None


def test_env_scan_keys_actions_and_records():
    env = _CountingEnv()
    scan = make_env_scan(env, random_actions(env), 4, record=lambda s: (s.env_state, s.obs, s.action, s.reward))
    rng = jax.random.PRNGKey(7)
    st0 = jnp.zeros(3, jnp.int32)
    carry, (st, obs, action, reward) = jax.jit(scan)(EnvCarry(st0, st0[:, None].astype(jnp.float32), rng))
    assert isinstance(carry, EnvCarry) and action.shape == (4, 3)
    # the documented key convention: rng, k_act, k_env = split(rng, 3); the action from k_act
    want, r = [], rng
    for _ in range(4):
        r, k_act, _ = jax.random.split(r, 3)
        want.append(jax.random.randint(k_act, (3,), 0, 5))
    np.testing.assert_array_equal(np.asarray(action), np.stack(want))
    np.testing.assert_array_equal(np.asarray(carry.rng), np.asarray(r))
    # record sees the state and observation the action was taken in, and the step's reward
    np.testing.assert_array_equal(np.asarray(st)[:, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(obs)[:, 0, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(reward), np.asarray(action, np.float32))
    assert int(carry.env_state[0]) == 4 and float(carry.obs[0, 0]) == 4
    # observations not carried (an env-only window): they stay None
    carry, out = jax.jit(make_env_scan(env, random_actions(env), 2))(EnvCarry(st0, None, rng))
    assert carry.obs is None and out is None and int(carry.env_state[0]) == 2
