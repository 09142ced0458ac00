"""The craftax text env: reset/step/termination/truncation, action parsing with invalid counting."""

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # compiles a Craftax-Classic reset/step (~1 min on a 2-core CPU)


@pytest.fixture(scope="module")
def env():
    from thinkcraft.envs.textenvs import CraftaxTextConfig, CraftaxTextEnv

    return CraftaxTextEnv(CraftaxTextConfig(env_kind="craftax-classic", max_steps=3, format_penalty=0.5))


def test_craftax_classic_text_env_reset_step_truncate(env):
    from thinkcraft.envs.textenvs import TextEnv

    assert isinstance(env, TextEnv)
    assert "Action:" in env.system_prompt and "Observation format" in env.system_prompt
    obs = env.reset([1, 1, 2])
    assert len(obs) == 3 and obs[0] == obs[1] and all(len(o) > 20 for o in obs)
    res = env.step(["Action: do", "I am not sure", "Action: 2"])
    assert [i["invalid"] for i in res.infos] == [False, True, False]
    assert res.infos[1]["action"] == 0  # invalid -> noop played
    assert res.rewards[1] == pytest.approx(res.infos[1]["env_reward"] - 0.5)
    assert not res.terminated.any() and not res.truncated.any()
    assert env.active_indices() == [0, 1, 2]
    env.step(["Action: noop"] * 3)
    res = env.step(["Action: noop"] * 3)
    assert res.truncated.all() and res.observations == ["", "", ""]  # the step cap ends every episode
    assert env.active_indices() == []
    c = env.counters()
    assert c["format/invalid"] == 1 and c["format/answers"] == 9
    # a new reset starts fresh episodes
    assert len(env.reset([3, 4])) == 2 and env.active_indices() == [0, 1]
    assert np.isfinite(res.rewards).all()


def test_stepping_a_subset_equals_stepping_all(env):
    """The continuous rollout steps the episodes whose turn came back (`indices`): each episode's next state,
    reward and text equal those of one call stepping every episode (its randomness is its own key's), the
    others keep theirs, and only the stepped episodes' texts are rendered."""
    actions = ["Action: do", "Action: move_left", "Action: noop"]
    env.reset([5, 6, 7])
    full = env.step(actions)
    env.reset([5, 6, 7])
    first = env.step([actions[0], actions[2]], indices=[0, 2])
    assert len(first.observations) == 2
    second = env.step([actions[1]], indices=[1])
    assert first.observations == [full.observations[0], full.observations[2]]
    assert second.observations == [full.observations[1]]
    np.testing.assert_allclose([*first.rewards, *second.rewards], full.rewards[[0, 2, 1]])
    assert env.active_indices() == [0, 1, 2]


def test_a_reset_state_and_a_stepped_state_share_one_compiled_step(env):
    """reset's state is strongly typed like a stepped one: the second step call does not compile the step again
    (it did: 24 weakly typed leaves after a reset; a Craftax-Symbolic step compile is tens of seconds)."""
    import jax

    env.reset([1, 2, 3])
    assert not [p for p, x in jax.tree_util.tree_leaves_with_path(env._state) if getattr(x, "weak_type", False)]
    env.step(["Action: noop"] * 3)
    old = jax.tree_util.tree_leaves((env._keys, env._state))
    env.step(["Action: noop"] * 3)
    assert env._advance._cache_size() == 1
    # the step writes the new state into the old one's buffers (donated; THINKCRAFT_ENV_DONATE=0 turns it off)
    assert env.donates_state and all(x.is_deleted() for x in old)


def test_step_observations_equal_a_fresh_render_of_the_state(env):
    """reset and step hand back texts from the semantic arrays their one compiled call extracted alongside
    (one dispatch and one device->host copy a turn): they equal a separate extract + render of the state
    they leave, for the stepped rows of a subset step too."""
    import jax

    def fresh(rows):
        texts = env._text.render(jax.device_get(env._text.extract(env._state, batched=True)), fmt="compact",
                                 env_kind=env.config.env_kind)
        return [texts[i] for i in rows]

    assert env.reset([8, 9, 10]) == fresh([0, 1, 2])
    res = env.step(["Action: do", "Action: move_left", "Action: move_up"])
    assert res.observations == fresh([0, 1, 2])
    res = env.step(["Action: move_right", "Action: noop"], indices=[2, 0])
    assert res.observations == fresh([2, 0]) and res.observations != fresh([0, 2])
    assert env._advance._cache_size() == 1


def test_command_buffer_options_compile_and_stay_off_without_a_gpu(monkeypatch):
    """THINKCRAFT_ENV_CMDBUF=1's per-jit options are XLA debug options this JAX accepts (a function compiled with
    them gives its result), and the switch leaves a CPU-only env's calls as they are (the options are GPU ones)."""
    import jax
    import jax.numpy as jnp

    from thinkcraft.envs.textenvs.craftax import _COMMAND_BUFFER_OPTIONS, CraftaxTextConfig, CraftaxTextEnv

    f = jax.jit(lambda x: x * 2 + 1, compiler_options=_COMMAND_BUFFER_OPTIONS)
    np.testing.assert_array_equal(np.asarray(f(jnp.arange(3.0))), [1.0, 3.0, 5.0])
    monkeypatch.setenv("THINKCRAFT_ENV_CMDBUF", "1")
    env = CraftaxTextEnv(CraftaxTextConfig(env_kind="craftax-classic"))
    assert env.command_buffers is (jax.default_backend() == "gpu")
    monkeypatch.setenv("THINKCRAFT_ENV_CMDBUF", "yes")
    with pytest.raises(Exception, match="THINKCRAFT_ENV_CMDBUF must be 0 or 1"):
        CraftaxTextEnv(CraftaxTextConfig(env_kind="craftax-classic"))
