"""The memory policy (`--policy rnn`, Craftax_Baselines' ppo_rnn.py): the GRU scan, the sequence update's
minibatches, the update rerunning the rollout, learning a task that needs memory (tests/toy_env.py), and
`train ppo --policy rnn` end to end on tiny Craftax-Classic (slow)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_env import CueEnv

from thinkcraft.cli import main
from thinkcraft.rl.networks import ActorCritic, ActorCriticRNN
from thinkcraft.rl.ppo import (
    PPOHyper, env_minibatches, init_runner_state, initial_memory, make_optimizer, make_rollout, make_train_chunk,
    sequence_batch,
)

W = 16


def test_gru_scan_equals_a_step_by_step_loop_with_resets():
    """The network over a (T, N) sequence = a Python loop over its T = 1 form, where the loop zeroes the
    carry itself at each reset (and tells the network nothing): resets restart the memory, nothing else."""
    T, N, D, A = 7, 3, 5, 4
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(T, N, D)), jnp.float32)
    resets = jnp.asarray(rng.random((T, N)) < 0.3).at[0, 0].set(True)
    net = ActorCriticRNN(A, W)
    h0 = jnp.asarray(rng.normal(size=(N, W)), jnp.float32)
    params = net.init(jax.random.PRNGKey(1), h0, x, resets)
    h_seq, pi_seq, v_seq = net.apply(params, h0, x, resets)

    h = h0
    no_reset = jnp.zeros((1, N), bool)
    for t in range(T):
        h = jnp.where(resets[t][:, None], 0.0, h)
        h, pi, v = net.apply(params, h, x[t][None], no_reset)
        np.testing.assert_allclose(np.asarray(pi.logits[0]), np.asarray(pi_seq.logits[t]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(v[0]), np.asarray(v_seq[t]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_seq), rtol=1e-5, atol=1e-6)
    # the memory matters: the same inputs from another carry give other outputs
    _, pi_other, _ = net.apply(params, h0 + 1.0, x, jnp.zeros((T, N), bool))
    assert not np.allclose(np.asarray(pi_other.logits), np.asarray(pi_seq.logits))


def test_baselines_initialisation_scales():
    """Dense layers orthogonal with Baselines' ppo_rnn.py scales: sqrt 2 (embedding), 2 (head hidden
    layers), 0.01 actor / 1.0 critic outputs; zero biases."""
    net = ActorCriticRNN(5, 32)
    x = jnp.zeros((1, 1, 40))
    p = net.init(jax.random.PRNGKey(0), jnp.zeros((1, 32)), x, jnp.zeros((1, 1), bool))["params"]

    def scale(k):  # an orthogonal (n, m) matrix times s has singular values s
        return np.linalg.svd(np.asarray(k), compute_uv=False)

    np.testing.assert_allclose(scale(p["Dense_0"]["kernel"]), np.sqrt(2), rtol=1e-4)
    for head, out in (("MLP_0", 0.01), ("MLP_1", 1.0)):
        np.testing.assert_allclose(scale(p[head]["Dense_0"]["kernel"]), 2.0, rtol=1e-4)
        np.testing.assert_allclose(scale(p[head]["Dense_1"]["kernel"]), 2.0, rtol=1e-4)
        np.testing.assert_allclose(scale(p[head]["Dense_2"]["kernel"]), out, rtol=1e-4)
    biases = [v for path, v in jax.tree_util.tree_leaves_with_path(p) if "bias" in jax.tree_util.keystr(path)]
    assert biases and all(float(jnp.abs(b).max()) == 0 for b in biases)


def test_env_minibatches_keep_sequences_whole():
    T, N, M = 5, 8, 4
    ids = jnp.broadcast_to(jnp.arange(N), (T, N))  # env id at every step
    steps = jnp.broadcast_to(jnp.arange(T)[:, None], (T, N))
    h0 = jnp.arange(N, dtype=jnp.float32)[None, :, None] * jnp.ones((1, N, 3))
    mb_ids, mb_steps, mb_h0 = jax.device_get(env_minibatches(jax.random.PRNGKey(0), (ids, steps, h0), M))
    assert mb_ids.shape == (M, T, N // M) and mb_h0.shape == (M, 1, N // M, 3)
    # each minibatch column is one env's whole sequence, in time order, with that env's initial carry
    assert (mb_ids == mb_ids[:, :1, :]).all()
    assert (mb_steps == np.arange(T)[None, :, None]).all()
    assert (mb_h0[:, 0, :, 0] == mb_ids[:, 0, :]).all()
    # the minibatches partition the envs, shuffled
    assert sorted(mb_ids[:, 0, :].ravel().tolist()) == list(range(N))
    assert mb_ids[:, 0, :].ravel().tolist() != list(range(N))


def test_the_update_reruns_the_rollout_exactly():
    """The sequence inputs the update builds (the rollout's first memory, each step's reset = the previous
    step's done) reproduce the rollout's log-probs and values: the first minibatch's ratio is 1."""
    env = CueEnv(num_envs=4, length=3)
    net = ActorCriticRNN(env.num_actions, W)
    hp = PPOHyper(num_minibatches=2)
    tx = make_optimizer(1e-3, False, 1.0, 10, hp)
    runner = init_runner_state(env, net, tx, jax.random.PRNGKey(0), memory=initial_memory(env.num_envs, W))
    rollout = jax.jit(make_rollout(env, net.apply, 8))
    params = runner.train_state.params
    rs1, _, _ = rollout(params, runner.rollout)  # a second rollout starts mid-episode with a nonzero carry
    rs2, traj, _ = rollout(params, rs1)
    assert float(jnp.abs(rs1.memory.hidden).max()) > 0
    tr, *_ = sequence_batch(traj, traj.reward, traj.reward, rs1.memory)
    _, pi, value = net.apply(params, rs1.memory.hidden, *tr.obs)
    np.testing.assert_allclose(np.asarray(pi.log_prob(traj.action)), np.asarray(traj.log_prob), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(value), np.asarray(traj.value), rtol=1e-5, atol=1e-5)
    assert bool(traj.done[:-1].any()), "episodes must end inside the rollout for the resets to be exercised"
    # the memory at the end is the rollout's: reset flags are the last step's done
    np.testing.assert_array_equal(np.asarray(rs2.memory.reset), np.asarray(traj.done[-1]))


def _train(policy, env, updates=40):
    net = ActorCriticRNN(env.num_actions, W) if policy == "rnn" else ActorCritic(env.num_actions, W)
    hp = PPOHyper(num_minibatches=4)
    tx = make_optimizer(3e-3, False, 1.0, updates, hp)
    mem = initial_memory(env.num_envs, W) if policy == "rnn" else None
    runner = jax.jit(lambda r: init_runner_state(env, net, tx, r, memory=mem))(jax.random.PRNGKey(0))
    p0 = runner.train_state.params
    chunk = jax.jit(make_train_chunk(env, net.apply, 2 * env.length, hp, updates // 4))
    for _ in range(4):
        runner, m = chunk(runner)
    moved = any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(runner.train_state.params)))
    return float(m["_return_sum"] / m["_episodes"]), float(m["losses/total"]), moved


def test_the_rnn_learns_what_needs_memory_and_the_mlp_cannot():
    env = CueEnv(num_envs=16, num_actions=2, length=3)
    ret_rnn, loss, moved = _train("rnn", env)
    assert np.isfinite(loss) and moved
    assert ret_rnn > 0.9, ret_rnn  # recalls the first step's cue at the third
    ret_mlp, _, _ = _train("mlp", env)
    assert ret_mlp < 0.7, ret_mlp  # chance is 0.5: the task does need memory


TINY_RNN = ["--policy", "rnn", "--env-name", "craftax-classic", "--num-envs", "8", "--num-steps", "16",
            "--layer-width", "16", "--num-minibatches", "4", "--total-timesteps", "65536", "--updates-per-chunk", "2",
            "--optimistic-reset-ratio", "4", "--no-plot"]


@pytest.mark.slow
def test_train_ppo_rnn_resumes_exactly_and_evals(tmp_path):
    from test_train_ppo import _params, _same

    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(["train", "ppo", *TINY_RNN, "--run-dir", str(full), "--stop-after-updates", "4"]) == 0
    assert main(["train", "ppo", *TINY_RNN, "--run-dir", str(cut), "--stop-after-updates", "2"]) == 0
    p_cut, _ = _params(cut)
    assert main(["train", "ppo", "--resume", "--run-dir", str(cut), "--stop-after-updates", "2"]) == 0
    p_full, meta = _params(full)
    assert meta["update"] == 4 and _same(p_full, _params(cut)[0]) and not _same(p_full, p_cut)
    recs = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["losses/total"]) for r in recs)
    assert json.loads((full / "config.json").read_text())["policy"] == "rnn"
    # eval carries the memory across steps (exact resets)
    assert main(["eval", str(full), "--episodes", "2", "--num-envs", "2", "--steps-per-call", "64"]) == 0
    assert np.isfinite(json.loads((full / "eval.json").read_text())["return_mean"])


def test_rnn_config_checks(capsys):
    assert main(["train", "ppo", "--policy", "rnn", "--num-envs", "12", "--num-minibatches", "8"]) == 2
    assert "must divide num_envs=12" in capsys.readouterr().err
    assert main(["train", "ppo", "--policy", "lstm"]) == 2
