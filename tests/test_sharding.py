"""`--devices D` (rl/shards.py): PPO's envs split over D devices equal one device on the same global batch.

The multi-device checks run in a subprocess whose JAX has 4 forced host (CPU) devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=4`, which must be set before JAX initialises; this test
process's JAX is already up with one). Each check is a function of this module, run as
`python tests/test_sharding.py <check>`.

Tolerances (why not bit-exact): the sharded update sums each minibatch's gradients per device and then
across devices (an all-reduce), one device sums them in one pass; the float32 sums differ in their last
bits (~1e-8 on these parameters after one update). Every random draw is the same (threefry keys are data).
Over several updates Adam divides by sqrt(v) + 1e-5, which turns last-bit differences of near-zero
gradients into ~1e-7 parameter differences: the chunk checks allow 1e-5 on parameters, 1e-4 relative on
metrics, as tests/test_seeds.py does for the seed axis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
PARAM_ATOL = 1e-5
METRIC_RTOL = 1e-4


def run_check(name: str, *args: str, devices: int = 4, timeout: int = 900) -> str:
    """Run check `name` in a fresh Python whose JAX sees `devices` CPU devices; its stdout."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(Path(__file__)), name, *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"check {name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p.stdout


# ------------------------------------------------------------------------------------------------ tests


def test_sharded_update_is_todays_one_device_update_on_the_same_global_batch():
    """One minibatch per epoch: the sharded update (gradients averaged over 4 devices, advantages
    normalised over all of them) equals rl.ppo.ppo_update - today's program, unchanged - on the global batch
    the 4 shards' rollouts form; MLP and RNN, SGD and Adam."""
    out = run_check("update")
    assert out.count("ok") == 4, out


def test_sharded_chunk_equals_the_same_program_on_one_device_and_combines_with_seeds():
    """Two minibatches (stratified over the shards), 2 chunks × 2 updates: the chunk as shard_map over 4
    devices equals it vmapped over 4 shards on one device (its reference for the same global batch), for
    the MLP and the RNN, with 1 and 2 seeds; the state stays split over the devices, the parameters
    replicated."""
    out = run_check("chunk")
    assert out.count("ok") == 4, out


# `train ppo --devices 2` end to end and ppo-hidden on 2 devices: tests/test_sharding_runs.py (their checks are
# `check_train_ppo` / `check_ppo_hidden` below; a file of their own so that CI's two workers share the minutes)


def test_devices_config_checks_and_one_device_is_the_unsharded_program(capsys):
    import jax

    from thinkcraft.cli import main
    from thinkcraft.rl.ppo import make_train_chunk
    from thinkcraft.rl.shards import EnvShards, make_shards, over_shards
    from thinkcraft.utils.errors import UserError

    tiny = ["train", "ppo", "--env-name", "craftax-classic", "--num-envs", "8", "--num-steps", "4",
            "--total-timesteps", "64", "--no-plot"]
    assert main([*tiny, "--devices", "3"]) == 2
    assert "num_envs=8 must split evenly over 3 devices" in capsys.readouterr().err
    assert main([*tiny, "--devices", "2", "--policy", "rnn", "--num-minibatches", "8"]) == 2
    assert "must divide each device's 4 envs" in capsys.readouterr().err
    assert main([*tiny, "--devices", "0"]) == 2
    assert main([*tiny, "--num-processes", "2"]) == 2
    assert "need --coordinator-address" in capsys.readouterr().err
    try:  # this process's JAX has one device
        make_shards(len(jax.devices()) + 1)
        raise AssertionError("expected a UserError")
    except UserError as e:
        assert "JAX sees only" in str(e)
    one = make_shards(1)
    assert one == EnvShards(1) and one.axis_name is None
    chunk = make_train_chunk(None, None, 4, None, 1)
    assert over_shards(chunk, one, (0,), 0) is chunk  # D = 1 compiles exactly today's chunk


# ------------------------------------------------------------------------------------------------ checks
# (run in the 4-device subprocess)


def _setup(policy: str, num_minibatches: int, tx=None, n_per_shard: int = 4, D: int = 4):
    import jax
    from toy_env import CueEnv

    from thinkcraft.rl.networks import ActorCritic, ActorCriticRNN
    from thinkcraft.rl.ppo import PPOHyper, init_sharded_runner, initial_memory, make_optimizer

    env = CueEnv(num_envs=n_per_shard, length=3)
    hp = PPOHyper(num_minibatches=num_minibatches, update_epochs=2)
    net = ActorCriticRNN(env.num_actions, 16) if policy == "rnn" else ActorCritic(env.num_actions, 16)
    tx = tx or make_optimizer(3e-3, True, 1.0, 8, hp)
    mem = initial_memory(n_per_shard, 16) if policy == "rnn" else None
    init = jax.jit(lambda r: init_sharded_runner(env, net, tx, r, D, memory=mem))
    return env, hp, net, init


def _max_diff(a, b) -> float:
    import jax

    return max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def check_update() -> None:
    import jax
    import optax

    from thinkcraft.rl.ppo import RUNNER_AXES, make_rollout, policy_step, ppo_update
    from thinkcraft.rl.shards import AXIS, make_shards, over_shards

    D, T = 4, 6
    shards = make_shards(D)
    for policy in ("mlp", "rnn"):
        for opt in ("sgd", "adam"):
            tx = optax.sgd(0.05) if opt == "sgd" else None
            env, hp, net, init = _setup(policy, num_minibatches=1, tx=tx)
            rollout = make_rollout(env, net.apply, T)

            def sharded(runner):
                rs, traj, _ = rollout(runner.train_state.params, runner.rollout)
                _, _, last_value = policy_step(net.apply, runner.train_state.params, rs.obs, rs.memory)
                ts, m = ppo_update(runner.train_state, traj, last_value, rs.rng, hp, runner.rollout.memory, AXIS)
                return (traj, last_value), ts.params, m

            runner = shards.place(init(jax.random.PRNGKey(0)), RUNNER_AXES)
            (traj, last_value), p_sharded, m_sharded = jax.device_get(
                jax.jit(over_shards(sharded, shards, (RUNNER_AXES,), (0, None, None)))(runner))

            # the same global batch as one (T, N) trajectory: shard d's env i is env d·n + i
            def merge(x):
                return np.moveaxis(x, 0, 1).reshape((x.shape[1], -1) + x.shape[3:])

            g_traj, g_last = jax.tree.map(merge, traj), last_value.reshape(-1)
            memory = jax.device_get(runner.rollout.memory)
            if memory is not None:
                memory = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), memory)
            ts = jax.device_get(runner.train_state)
            ts1, m_one = jax.jit(lambda ts, tr, lv, mem: ppo_update(ts, tr, lv, jax.random.PRNGKey(1), hp, mem))(
                ts, g_traj, g_last, memory)
            diff = _max_diff(p_sharded, ts1.params)
            step = _max_diff(ts1.params, ts.params)
            assert diff < 1e-6 and step > 1e-3, (policy, opt, diff, step)
            for k, v in jax.device_get(m_one).items():
                np.testing.assert_allclose(m_sharded[k], v, rtol=METRIC_RTOL, atol=1e-6, err_msg=k)
            print("ok", policy, opt, f"max |Δparam| {diff:.1e} (update size {step:.1e})")


def check_chunk() -> None:
    import jax

    from thinkcraft.rl.ppo import RUNNER_AXES, make_train_chunk
    from thinkcraft.rl.seeds import init_seeds, over_seeds
    from thinkcraft.rl.shards import AXIS, EnvShards, make_shards, over_shards

    D = 4
    for policy in ("mlp", "rnn"):
        env, hp, net, init = _setup(policy, num_minibatches=2)
        chunk = make_train_chunk(env, net.apply, 6, hp, 2, axis_name=AXIS)
        for K in (1, 2):
            results = []
            for shards in (make_shards(D), EnvShards(D)):  # 4 devices; vmapped on one
                state = shards.place(init_seeds(init, 3, K), RUNNER_AXES, K)
                f = jax.jit(over_seeds(over_shards(chunk, shards, (RUNNER_AXES,), (RUNNER_AXES, None)), K),
                            donate_argnums=0)
                for _ in range(2):
                    state, metrics = f(state)
                if shards.mesh is not None:
                    leaf = jax.tree.leaves(state.rollout.env_state)[0]
                    assert tuple(leaf.sharding.spec) == ((None, AXIS) if K > 1 else (AXIS,)), leaf.sharding
                    assert len(leaf.sharding.device_set) == D
                    p = jax.tree.leaves(state.train_state.params)[0]
                    shards_p = [np.asarray(s.data) for s in p.addressable_shards]
                    assert len(shards_p) == D and all(np.array_equal(shards_p[0], s) for s in shards_p)
                results.append(jax.device_get((state, metrics)))
            (s_mesh, m_mesh), (s_one, m_one) = results
            diff = _max_diff(s_mesh.train_state.params, s_one.train_state.params)
            assert diff < PARAM_ATOL, (policy, K, diff)
            assert _max_diff(s_mesh.rollout.obs, s_one.rollout.obs) == 0.0
            for k in m_one:
                np.testing.assert_allclose(m_mesh[k], m_one[k], rtol=METRIC_RTOL, atol=1e-6, err_msg=k)
            assert np.all(np.asarray(m_mesh["_episodes"]) > 0)
            print("ok", policy, f"seeds {K}", f"max |Δparam| {diff:.1e}")


def check_train_ppo(run_dir: str) -> None:
    """`train ppo --devices 2` on Classic: runs, checkpoints, resumes, evaluates; another --devices cannot resume it."""
    from thinkcraft.cli import main

    d = Path(run_dir)
    tiny = ["--env-name", "craftax-classic", "--num-envs", "8", "--num-steps", "8", "--layer-width", "32",
            "--total-timesteps", "256", "--updates-per-chunk", "2", "--optimistic-reset-ratio", "2", "--no-plot"]
    assert main(["train", "ppo", *tiny, "--devices", "2", "--run-dir", str(d), "--stop-after-updates", "2"]) == 0
    assert json.loads((d / "config.json").read_text())["_derived"]["env_shards"] == 2
    assert main(["train", "ppo", "--resume", "--run-dir", str(d), "--devices", "4"]) == 2  # a shape field
    assert main(["train", "ppo", "--resume", "--run-dir", str(d)]) == 0
    recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in recs] == [2, 4] and all(np.isfinite(r["losses/total"]) for r in recs)
    assert main(["eval", str(d), "--episodes", "2", "--num-envs", "2", "--steps-per-call", "64"]) == 0
    print("ok train ppo --devices 2")


def check_ppo_hidden(run_dir: str) -> None:
    """`train ppo-hidden --devices 2` (reset pool, --overlap and not) equals the same program vmapped on one
    device (make_shards patched to the emulation), metric by metric."""
    from unittest import mock

    import torch

    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.testing import tiny_llama
    from thinkcraft.rl.shards import EnvShards
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig, run
    from test_seeds import _records

    torch.manual_seed(0)
    engine = HFEngine.from_model(*tiny_llama())
    common = dict(env_name="craftax-classic", num_envs=4, num_steps=8, skip_n=4, layer_width=16, hidden_proj_dim=8,
                  num_minibatches=2, optimistic_reset_ratio=2, total_timesteps=64, devices=2, plot=False)
    for overlap in (False, True):
        dirs = [Path(run_dir) / f"mesh-{overlap}", Path(run_dir) / f"one-{overlap}"]
        run(PPOHiddenConfig(**common, overlap=overlap, run_dir=str(dirs[0])), engine=engine)
        with mock.patch("thinkcraft.rl.shards.make_shards", lambda devices: EnvShards(int(devices))):
            run(PPOHiddenConfig(**common, overlap=overlap, run_dir=str(dirs[1])), engine=engine)
        a, b = (_records(d) for d in dirs)
        assert len(a) == len(b) == 2
        for ra, rb in zip(a, b):
            assert ra.keys() == rb.keys() and ra["hidden/valid_frac"] == 1
            for k in ra:
                np.testing.assert_allclose(ra[k], rb[k], rtol=METRIC_RTOL, atol=1e-5, err_msg=k)
        print("ok ppo-hidden --devices 2", "overlap" if overlap else "sync")


if __name__ == "__main__":
    globals()[f"check_{sys.argv[1]}"](*sys.argv[2:])
