"""Craftax wrappers and `thinkcraft train ppo` / `eval` end to end, on tiny Craftax-Classic shapes.

Every run here shares one config shape (so the persistent JAX cache compiles the chunk once): 512 updates
of which each test runs a few (--stop-after-updates), so that a SIGTERM lands mid-run.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import flax.serialization
import numpy as np
import pytest

from thinkcraft.cli import main
from thinkcraft.envs.craftax import fresh_world_index, make_env
from thinkcraft.train.checkpoint import latest_meta
from thinkcraft.utils.errors import UserError

pytestmark = pytest.mark.slow

TINY = [
    "--env-name", "craftax-classic", "--num-envs", "8", "--num-steps", "16", "--layer-width", "64",
    "--total-timesteps", "65536", "--updates-per-chunk", "2", "--optimistic-reset-ratio", "4",
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
    from thinkcraft.train.checkpoint import read_checkpoint

    cp, _ = read_checkpoint(run_dir)
    return jax.tree_util.tree_leaves(flax.serialization.msgpack_restore(cp.files["params.msgpack"])), cp.meta


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_train_resume_equals_uninterrupted_and_eval(tmp_path, capsys):
    runs = tmp_path / "runs"
    full, cut = runs / "full", runs / "cut"
    # uninterrupted: 4 updates in 2 chunks
    assert main(["train", "ppo", *TINY, "--run-dir", str(full), "--no-plot", "--stop-after-updates", "4"]) == 0
    # interrupted after the first chunk, then resumed
    assert main(["train", "ppo", *TINY, "--run-dir", str(cut), "--stop-after-updates", "2"]) == 0
    p_cut, meta = _params(cut)
    assert meta["update"] == 2
    assert main(["train", "ppo", *TINY, "--run-dir", str(cut)]) == 2  # never silently reused
    # a shape-changing field that differs from the saved run is refused before compiling
    assert main(["train", "ppo", "--resume", "--run-dir", str(cut), "--num-envs", "16"]) == 2
    capsys.readouterr()
    # every field from the saved run (Classic, 8 envs, 2 more updates), title and totals included
    assert main(["train", "ppo", "--resume", "--run-dir", str(cut)]) == 0
    err = capsys.readouterr().err
    assert f"resuming {cut} from update 2 (256 steps)" in err
    assert "PPO Craftax-Classic-Symbolic-v1: 512/65,536 steps" in err
    assert "Craftax-Symbolic-v1" not in err

    p_full, meta_full = _params(full)
    p_res, meta_res = _params(cut)
    assert meta_full["update"] == meta_res["update"] == 4
    assert _same(p_full, p_res) and not _same(p_full, p_cut)

    def recs(d):
        lines = (d / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(l).items() if not k.startswith("timing") and k not in ("time_s", "sps")}
                for l in lines]

    assert recs(full) == recs(cut)  # same losses and episode stats, no duplicated lines after resume
    assert (cut / "curve.png").stat().st_size > 1000
    keys = recs(full)[-1].keys()
    assert {"losses/total", "losses/entropy", "episode/count", "update"} <= set(keys)

    # a damaged checkpoint: one line naming the file; --resume-fallback redoes the lost chunk exactly
    state = cut / "checkpoint" / "00000004" / "state.msgpack"
    b = bytearray(state.read_bytes())
    b[len(b) // 3] ^= 0x01
    state.write_bytes(bytes(b))
    capsys.readouterr()
    assert main(["train", "ppo", "--resume", "--run-dir", str(cut)]) == 2
    err = capsys.readouterr().err
    assert f"{state} is corrupt" in err and "--resume-fallback" in err
    assert main(["train", "ppo", "--resume", "--run-dir", str(cut), "--resume-fallback"]) == 0
    assert f"resuming {cut} from update 2 (256 steps)" in capsys.readouterr().err
    assert _same(_params(cut)[0], p_full) and recs(full) == recs(cut)

    # eval the trained policy
    assert main(["eval", str(full), "--episodes", "4", "--num-envs", "4", "--steps-per-call", "64"]) == 0
    report = json.loads((full / "eval.json").read_text())
    assert report["episodes"] == 4 and np.isfinite(report["return_mean"])
    assert set(report["achievement_rates"]) >= {"collect_wood", "place_table"}


def test_sigterm_checkpoints_after_the_chunk_in_flight_and_exits_0(tmp_path):
    """A scheduler's preemption: SIGTERM mid-run -> the chunk in flight finishes, a checkpoint, exit 0 and
    the resume command printed; the run then continues from there."""
    d = tmp_path / "run"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "thinkcraft", "train", "ppo", *TINY, "--run-dir", str(d), "--no-plot"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = d / "metrics.jsonl"
    deadline = time.time() + 900
    while not (metrics.exists() and metrics.read_text().strip()):  # training is under way
        assert p.poll() is None, p.communicate()
        assert time.time() < deadline, "no metrics after 15 min"
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    meta = latest_meta(d)
    assert 2 <= meta["update"] < 512, "the run should stop mid-way"
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps[-1] == meta["env_steps"]
    assert f"SIGTERM: stopped at update {meta['update']}" in err
    assert f"continue with: thinkcraft train ppo --resume --run-dir {d}" in err
    assert main(["train", "ppo", "--resume", "--run-dir", str(d), "--stop-after-updates", "2", "--no-plot"]) == 0
    assert latest_meta(d)["update"] == meta["update"] + 2
