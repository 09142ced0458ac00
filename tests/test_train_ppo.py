"""Craftax wrappers and `thinkcraft train ppo` / `eval` end to end, on tiny Craftax-Classic shapes.

Every run here shares one config shape (so the persistent JAX cache compiles the chunk once).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from thinkcraft.cli import main
from thinkcraft.envs.craftax import fresh_world_index, make_env
from thinkcraft.utils.errors import UserError

pytestmark = pytest.mark.slow

TINY = [
    "--env-name", "craftax-classic", "--num-envs", "8", "--num-steps", "16", "--layer-width", "64",
    "--total-timesteps", "512", "--updates-per-chunk", "2", "--optimistic-reset-ratio", "4",
]


def test_vec_env_logs_returns_and_auto_resets_to_fresh_worlds():
    env = make_env("Craftax-Classic-Symbolic-v1", num_envs=4, reset_ratio=2)
    env = dataclasses.replace(env, params=env.params.replace(max_timesteps=25))  # episodes surely end
    n_fresh = env.num_resets_per_step

    def step(carry, _):
        state, obs, rng = carry
        rng, k_a, k = jax.random.split(rng, 3)
        action = jax.random.randint(k_a, (env.num_envs,), 0, env.num_actions)
        obs2, state2, reward, done, info = env.step(k, state, action)
        # independent recomputation of what the wrapper must return
        k_step, k_reset, k_rank = jax.random.split(k, 3)
        cont_obs, _, _, _, _ = jax.vmap(env.base.step_env, in_axes=(0, 0, 0, None))(
            jax.random.split(k_step, env.num_envs), state.env_state, action, env.params)
        fresh_obs, _ = jax.vmap(env.base.reset_env, in_axes=(0, None))(jax.random.split(k_reset, n_fresh), env.params)
        expect = jnp.where(done[:, None], fresh_obs[fresh_world_index(done, n_fresh, k_rank)], cont_obs)
        return (state2, obs2, rng), (reward, done, info, jnp.abs(obs2 - expect).max(), state2.episode_returns)

    @jax.jit
    def rollout(rng):
        obs, state = env.reset(rng)
        return jax.lax.scan(step, (state, obs, rng), None, 60)[1]

    reward, done, info, obs_err, running = jax.device_get(rollout(jax.random.PRNGKey(3)))
    assert done.sum() >= 4, "every env should finish an episode by the 25-step timeout"
    assert float(obs_err.max()) == 0.0  # reset obs where done, continuation obs elsewhere
    # the logged return is the sum of rewards since the env's previous episode end
    acc = np.zeros(env.num_envs)
    for t in range(reward.shape[0]):
        acc += reward[t]
        for e in np.nonzero(done[t])[0]:
            np.testing.assert_allclose(info.episode_return[t, e], acc[e], rtol=1e-5, atol=1e-5)
            assert info.episode_length[t, e] <= 25
            acc[e] = 0.0
        np.testing.assert_allclose(running[t], acc, rtol=1e-5, atol=1e-5)


def test_bad_input_fails_fast_with_clear_errors(tmp_path, capsys):
    assert main(["train", "ppo", "--env-name", "Craftax-Foo"]) == 2
    assert "valid names" in capsys.readouterr().err
    assert main(["train", "ppo", "--num-envs", "10", "--num-steps", "3", "--num-minibatches", "4"]) == 2
    assert "not divisible by 4 minibatches" in capsys.readouterr().err
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "config.json").write_text("{}")
    assert main(["train", "ppo", *TINY, "--runs-dir", str(tmp_path / "runs"), "--run-name", "x"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    with pytest.raises(UserError):
        make_env("Craftax-Classic-Symbolic-v1", num_envs=6, reset_ratio=4)


def _params(run_dir):
    from thinkcraft.train.checkpoint import latest_meta

    meta = latest_meta(run_dir)
    import flax.serialization

    return flax.serialization.msgpack_restore((run_dir / "checkpoint" / "params.msgpack").read_bytes()), meta


def test_train_resume_equals_uninterrupted_and_eval(tmp_path):
    runs = str(tmp_path / "runs")
    # uninterrupted: 4 updates in 2 chunks
    assert main(["train", "ppo", *TINY, "--runs-dir", runs, "--run-name", "full", "--no-plot"]) == 0
    # interrupted after the first chunk, then resumed
    assert main(["train", "ppo", *TINY, "--runs-dir", runs, "--run-name", "cut", "--stop-after-updates", "2"]) == 0
    p_cut, meta = _params(tmp_path / "runs" / "cut")
    assert meta["update"] == 2
    # a shape-changing field that differs from the saved run is refused before compiling
    assert main(["train", "ppo", "--resume", f"{runs}/cut", "--num-envs", "16"]) == 2
    assert main(["train", "ppo", "--resume", f"{runs}/cut"]) == 0

    p_full, meta_full = _params(tmp_path / "runs" / "full")
    p_res, meta_res = _params(tmp_path / "runs" / "cut")
    assert meta_full["update"] == meta_res["update"] == 4
    flat_full = jax.tree_util.tree_leaves(p_full)
    flat_res = jax.tree_util.tree_leaves(p_res)
    assert all(np.array_equal(a, b) for a, b in zip(flat_full, flat_res))
    assert not all(np.array_equal(a, b) for a, b in zip(flat_full, jax.tree_util.tree_leaves(p_cut)))

    def recs(name):
        lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(l).items() if not k.startswith("timing") and k not in ("time_s", "sps")}
                for l in lines]

    assert recs("full") == recs("cut")  # same losses and episode stats, no duplicated lines after resume
    assert (tmp_path / "runs" / "cut" / "curve.png").stat().st_size > 1000
    keys = recs("full")[-1].keys()
    assert {"losses/total", "losses/entropy", "episode/count", "update"} <= set(keys)

    # eval the trained policy
    assert main(["eval", f"{runs}/full", "--episodes", "4", "--num-envs", "4", "--steps-per-call", "64"]) == 0
    report = json.loads((tmp_path / "runs" / "full" / "eval.json").read_text())
    assert report["episodes"] == 4 and np.isfinite(report["return_mean"])
    assert set(report["achievement_rates"]) >= {"collect_wood", "place_table"}
