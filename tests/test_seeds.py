"""`--num-seeds K`: K seeds vmapped in one program (rl/seeds.py). Seed i equals a single run with seed + i.

Tolerance: not bit-exact. The vmapped chunk's matmuls and reductions carry a seed axis, and XLA's CPU
backend sums them in another order than the unbatched program, so parameters differ by float32 rounding
(~1e-7 after a few updates here). Every random draw is identical (threefry keys are data under vmap) and
the initial state is the same jitted init's output, so nothing else differs; over a long run those
rounding differences can make two otherwise equal trajectories drift apart (as on two GPU models).
The tests allow 1e-5 absolute on parameters and 1e-4 relative on metrics.
"""

import json

import jax
import numpy as np
import pytest
from toy_env import CueEnv

from thinkcraft.cli import main
from thinkcraft.rl.networks import ActorCritic, ActorCriticRNN
from thinkcraft.rl.ppo import PPOHyper, init_runner_state, initial_memory, make_optimizer, make_train_chunk
from thinkcraft.rl.seeds import init_seeds, over_seeds, seed_slice, split_seeds

PARAM_ATOL = 1e-5
METRIC_RTOL = 1e-4


def _close_trees(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=PARAM_ATOL)


@pytest.mark.parametrize("policy", ["mlp", "rnn"])
def test_seed_i_of_a_vmapped_program_is_the_single_run_with_seed_plus_i(policy):
    env = CueEnv(num_envs=8, length=3)
    hp = PPOHyper(num_minibatches=4)
    net = ActorCriticRNN(env.num_actions, 16) if policy == "rnn" else ActorCritic(env.num_actions, 16)
    tx = make_optimizer(3e-3, True, 1.0, 8, hp)
    mem = initial_memory(env.num_envs, 16) if policy == "rnn" else None
    init = jax.jit(lambda r: init_runner_state(env, net, tx, r, memory=mem))
    chunk = make_train_chunk(env, net.apply, 6, hp, 4)
    K, seed = 3, 5
    multi = init_seeds(init, seed, K)
    assert multi.update.shape == (K,)
    chunk_k = jax.jit(over_seeds(chunk, K))
    for _ in range(2):
        multi, m_multi = chunk_k(multi)
    per_seed = split_seeds(jax.device_get(m_multi), K)
    chunk_1 = jax.jit(chunk)
    for i in range(K):
        single = init(jax.random.PRNGKey(seed + i))
        for _ in range(2):
            single, m_single = chunk_1(single)
        _close_trees(seed_slice(multi.train_state.params, i, K), single.train_state.params)
        for k, v in jax.device_get(m_single).items():
            np.testing.assert_allclose(per_seed[i][k], v, rtol=METRIC_RTOL, atol=1e-6, err_msg=k)
    # the seeds are different runs
    assert not np.allclose(np.asarray(jax.tree.leaves(multi.train_state.params)[0][0]),
                           np.asarray(jax.tree.leaves(multi.train_state.params)[0][1]))
    # one seed keeps no seed axis: the single program itself
    assert over_seeds(chunk, 1) is chunk and init_seeds(init, seed, 1).update.shape == ()


TINY = ["--env-name", "craftax-classic", "--num-envs", "8", "--num-steps", "16", "--layer-width", "64",
        "--total-timesteps", "65536", "--updates-per-chunk", "2", "--optimistic-reset-ratio", "4", "--no-plot"]


def _records(run_dir):
    """Metrics records without wall-clock ones and those of the LLM calls (shared by the seeds)."""
    skip = ("time_s", "sps", "sps_per_seed")
    return [{k: v for k, v in json.loads(line).items()
             if not k.startswith(("timing", "llm/")) and k not in skip}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_seed_equals_single(multi_dir, single_dir, seed_index, num_seeds):
    from test_train_ppo import _params

    recs = _records(multi_dir)
    mine = [r for r in recs if r.pop("seed_index") == seed_index]
    assert len(recs) == num_seeds * len(mine)
    single = _records(single_dir)
    assert len(mine) == len(single) and all("seed_index" not in r for r in single)  # K = 1: no index
    for a, b in zip(mine, single):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=METRIC_RTOL, atol=1e-6, err_msg=k)
    p_multi, meta = _params(multi_dir)
    p_single, _ = _params(single_dir)
    assert len(p_multi) == len(p_single)
    for x, y in zip(p_multi, p_single):
        assert x.shape == (num_seeds,) + y.shape
        np.testing.assert_allclose(x[seed_index], y, rtol=0, atol=PARAM_ATOL)
    return meta


@pytest.mark.slow
def test_train_ppo_num_seeds_equals_single_runs_resumes_and_evals(tmp_path, capsys):
    multi, single = tmp_path / "multi", tmp_path / "single"
    # 2 seeds (3, 4) in one program, cut after one chunk and resumed; then seed 4 alone
    assert main(["train", "ppo", *TINY, "--seed", "3", "--num-seeds", "2", "--run-dir", str(multi),
                 "--stop-after-updates", "2"]) == 0
    assert "× 2 seeds" in capsys.readouterr().err
    assert main(["train", "ppo", "--resume", "--run-dir", str(multi), "--stop-after-updates", "2"]) == 0
    assert main(["train", "ppo", *TINY, "--seed", "4", "--run-dir", str(single), "--stop-after-updates", "4"]) == 0
    meta = _check_seed_equals_single(multi, single, seed_index=1, num_seeds=2)
    assert meta["update"] == 4
    cfg = json.loads((multi / "config.json").read_text())
    assert cfg["num_seeds"] == 2 and cfg["seed"] == 3
    # eval / collect pick a seed; an index past K is one clear line
    assert main(["eval", str(multi), "--seed-index", "1", "--episodes", "2", "--num-envs", "2",
                 "--steps-per-call", "64"]) == 0
    assert json.loads((multi / "eval.json").read_text())["seed_index"] == 1
    capsys.readouterr()
    assert main(["eval", str(multi), "--seed-index", "2"]) == 2
    assert "holds 2 seed(s)" in capsys.readouterr().err


class _CountingEngine:
    """An engine that records the batch size of every hidden-state call (everything else delegated)."""

    def __init__(self, engine):
        self._engine = engine
        self.batch_sizes = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def hidden_states_torch(self, batch, *args, **kwargs):
        self.batch_sizes.append(len(batch))
        return self._engine.hidden_states_torch(batch, *args, **kwargs)


@pytest.mark.slow
def test_ppo_hidden_rnn_num_seeds_encodes_all_seeds_in_one_call_and_equals_single_run(tmp_path):
    """ppo-hidden with --policy rnn --num-seeds 2: each refresh is one engine call on both seeds' envs and
    reset pools, and seed 1 equals the single run with seed + 1 (the LLM's hidden states of the same text are
    the same up to float rounding whatever batch they are computed in). --overlap runs with seeds too."""
    import torch

    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.testing import tiny_llama
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig, run

    torch.manual_seed(0)
    engine = HFEngine.from_model(*tiny_llama())
    common = dict(env_name="craftax-classic", num_envs=2, num_steps=8, skip_n=4, layer_width=16, hidden_proj_dim=8,
                  num_minibatches=2, optimistic_reset_ratio=1, total_timesteps=32, policy="rnn", plot=False)
    multi = _CountingEngine(engine)
    cfg = PPOHiddenConfig(**common, seed=0, num_seeds=2, run_dir=str(tmp_path / "multi"))
    rows = cfg.num_envs + cfg.pool_size  # each seed's envs and its reset pool's worlds
    run(cfg, engine=multi)
    assert multi.batch_sizes == [2 * rows] * 4  # 2 updates × 2 refreshes, each on both seeds
    single = _CountingEngine(engine)
    run(PPOHiddenConfig(**common, seed=1, run_dir=str(tmp_path / "single")), engine=single)
    assert single.batch_sizes == [rows] * 4
    _check_seed_equals_single(tmp_path / "multi", tmp_path / "single", seed_index=1, num_seeds=2)

    # overlapped refreshes: the first call also encodes the next interval's pool, the later ones run in the worker
    overlap = _CountingEngine(engine)
    run(PPOHiddenConfig(**common, seed=0, num_seeds=2, overlap=True, run_dir=str(tmp_path / "overlap")), engine=overlap)
    assert overlap.batch_sizes == [2 * (rows + cfg.pool_size)] + [2 * rows] * 3
    recs = _records(tmp_path / "overlap")
    assert sorted(r["seed_index"] for r in recs) == [0, 0, 1, 1] and all(r["hidden/valid_frac"] == 1 for r in recs)
