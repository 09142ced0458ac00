"""The Craftax wrapper's unrolled inner loops (`VecEnv.unroll_inner_scans`): same states, no loops left."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from thinkcraft.envs.craftax import make_env, unrolled_scans
from thinkcraft.train.ppo import PPOConfig


def _rolled_loops(env) -> int:
    """Scans inside one traced env step whose iterations stay a loop (unroll < length), and whiles."""
    def step(rng, st):
        a = jnp.zeros((env.num_envs,), jnp.int32)
        return env.step(rng, st, a)[1]

    _, st = jax.eval_shape(env.reset, jax.random.PRNGKey(0))
    jaxpr = jax.make_jaxpr(step)(jax.random.PRNGKey(0), st).jaxpr
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


@pytest.mark.parametrize("name", ["Craftax-Classic-Symbolic-v1", pytest.param("Craftax-Symbolic-v1", marks=pytest.mark.slow)])
def test_unrolled_step_has_no_loops_left(name):
    # Tracing only (no compile). craftax's step holds short scans and jax.random.choice's binary searches
    assert _rolled_loops(make_env(name, 4, 2)) > 10
    assert _rolled_loops(make_env(name, 4, 2, unroll_inner_scans=True)) == 0
    # the swap is undone after the trace
    assert jax.lax.scan.__module__.startswith("jax") and jnp.searchsorted.__module__.startswith("jax")


@pytest.mark.slow  # compiles a Craftax-Classic scan twice (rolled, unrolled)
def test_unrolled_env_gives_the_same_states_bit_for_bit():
    n, steps = 4, 6
    out = {}
    for unroll in (False, True):
        env = make_env("Craftax-Classic-Symbolic-v1", n, 2, unroll_inner_scans=unroll)

        def run(rng, env=env):
            obs, st = env.reset(rng)

            def body(st, k):
                a = jax.random.randint(k, (n,), 0, env.num_actions)
                obs, st, r, d, _ = env.step(k, st, a)
                return st, (obs, r, d)

            return jax.lax.scan(body, st, jax.random.split(rng, steps))

        out[unroll] = jax.device_get(jax.jit(run)(jax.random.PRNGKey(3)))
    a, b = jax.tree.leaves(out[False]), jax.tree.leaves(out[True])
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_unrolled_scans_disabled_is_a_no_op():
    before = jax.lax.scan
    with unrolled_scans(False):
        assert jax.lax.scan is before
    with unrolled_scans(True):
        assert jax.lax.scan is not before
    assert jax.lax.scan is before


def test_unroll_env_scans_auto_follows_the_backend():
    assert PPOConfig(unroll_env_scans="auto").unrolled_env_scans == (jax.default_backend() == "gpu")
    assert PPOConfig(unroll_env_scans="on").unrolled_env_scans is True
    assert PPOConfig(unroll_env_scans="off").unrolled_env_scans is False


def test_bad_unroll_env_scans_is_a_clear_error(capsys):
    from thinkcraft.cli import main
    from thinkcraft.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="--unroll-env-scans: auto, on or off"):
        PPOConfig(unroll_env_scans="maybe")
    assert main(["train", "ppo", "--unroll-env-scans", "maybe"]) == 2
    assert "unroll-env-scans" in capsys.readouterr().err
