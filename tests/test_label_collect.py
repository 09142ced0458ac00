"""`thinkcraft collect` (a tiny Craftax-Classic rollout) feeding `thinkcraft label`."""

import json

import pyarrow.parquet as pq
import pytest

from thinkcraft.cli import main
from thinkcraft.label.collect import CollectConfig
from thinkcraft.utils.errors import ConfigError, UserError

from test_label_remote import endpoints_toml, stub  # noqa: F401 - stub is a fixture


def test_collect_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="pixel"):
        CollectConfig(env_name="Craftax-Pixels-v1")
    with pytest.raises(ConfigError, match="policy"):
        CollectConfig(policy="sac")
    with pytest.raises(ConfigError, match="not a `train ppo` run dir"):
        CollectConfig(policy=f"ppo:{tmp_path}")


@pytest.mark.slow
def test_collect_then_label(tmp_path, stub):
    out = tmp_path / "states"
    # Classic: a ~1 min compile on a 2-core CPU (Craftax-Symbolic takes several)
    args = ["collect", "--out", str(out), "--env-name", "Craftax-Classic-Symbolic-v1", "--num-envs", "2",
            "--num-steps", "6", "--steps-per-call", "3", "--every", "2", "--seed", "3"]
    assert main(args) == 0
    t = pq.read_table(out)  # the folder reads as one dataset (the report is `_collect.json`)
    assert t.num_rows == 2 * 3  # steps 0, 2, 4 of 2 envs
    assert t.column("step").to_pylist() == [0, 0, 2, 2, 4, 4]
    assert t.column("env_index").to_pylist() == [0, 1] * 3
    assert set(t.column("env").to_pylist()) == {"Craftax-Classic-Symbolic-v1"}
    rows = t.to_pylist()
    for r in rows:
        assert len(r["obs"]) == 1345  # Classic symbolic observation
        assert r["craftax_text"].startswith("Map:") and "health" in r["compact_text"]
        assert len(r["compact_text"]) < len(r["craftax_text"])
    # step 0 of each env is a fresh world: full vitals
    assert "health 9" in rows[0]["compact_text"]
    assert json.loads((out / "_collect.json").read_text())["rows"] == 6
    assert main(args) == 2  # refuses to mix two rollouts in one folder

    # the collected folder is a label input as is (compact_text column picked by default)
    url, st = stub()
    eps = endpoints_toml(tmp_path / "ep.toml", {"name": "s", "base_url": url, "model": "m"})
    assert main(["label", "--input", str(out), "--out-dir", str(tmp_path / "lab"), "--endpoints", str(eps),
                 "--fields", "action:string,n:integer"]) == 0
    # identical states (e.g. a step that changed nothing in view) are one item: labelled once
    assert st.n == len({r["compact_text"] for r in rows})
    # requests run concurrently: any order
    assert rows[0]["compact_text"] in [b["messages"][1]["content"] for b in st.bodies]


def test_ppo_policy_loads_from_a_run_dir(tmp_path):
    """`--policy ppo:<run_dir>` loads the checkpoint's network and samples actions (no env compile here)."""
    import flax.serialization
    import jax
    import numpy as np

    from thinkcraft.label.collect import _make_policy
    from thinkcraft.train.checkpoint import commit_checkpoint, save_config
    from thinkcraft.train.ppo import PPOConfig, build

    pcfg = PPOConfig(env_name="Craftax-Classic-Symbolic-v1", num_envs=4, layer_width=32)
    env, network, _ = build(pcfg)
    params = network.init(jax.random.PRNGKey(0), np.zeros((1, env.obs_dim), np.float32))
    save_config(tmp_path, pcfg)
    commit_checkpoint(tmp_path, {"params.msgpack": flax.serialization.to_bytes(params)}, {"update": 1, "env_steps": 1})
    cfg = CollectConfig(policy=f"ppo:{tmp_path}", num_envs=2)
    venv, act, after_step, memory, name = _make_policy(cfg)
    assert name == "Craftax-Classic-Symbolic-v1" and venv.num_envs == 2 and memory is None
    a = np.asarray(act(np.zeros((2, venv.obs_dim), np.float32), jax.random.PRNGKey(1)))
    assert a.shape == (2,) and ((0 <= a) & (a < venv.num_actions)).all()


def test_a_seed_of_a_multi_seed_rnn_run_loads_with_its_memory(tmp_path):
    """`--seed-index i` of a `--num-seeds K` run: seed i's parameters (the checkpoint stacks all K); a
    recurrent policy acts with its memory as the scan's policy state."""
    import flax.serialization
    import jax
    import numpy as np

    from thinkcraft.label.collect import _make_policy
    from thinkcraft.rl.ppo import init_params, initial_memory
    from thinkcraft.train.checkpoint import commit_checkpoint, save_config
    from thinkcraft.train.evaluate import load_ppo_policy
    from thinkcraft.train.ppo import PPOConfig, build

    pcfg = PPOConfig(env_name="Craftax-Classic-Symbolic-v1", num_envs=4, layer_width=8, policy="rnn", num_seeds=2,
                     num_minibatches=2)
    env, network, _ = build(pcfg)
    x = np.zeros((1, env.obs_dim), np.float32)
    seeds = [init_params(network, jax.random.PRNGKey(i), x, initial_memory(1, 8)) for i in range(2)]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *seeds)
    save_config(tmp_path, pcfg)
    commit_checkpoint(tmp_path, {"params.msgpack": flax.serialization.to_bytes(stacked)}, {"update": 1, "env_steps": 1})
    _, _, params, tcfg = load_ppo_policy(tmp_path, 2, seed_index=1)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(seeds[1])))
    assert tcfg.num_seeds == 1 and tcfg.seed == 1
    venv, act, after_step, memory, _ = _make_policy(CollectConfig(policy=f"ppo:{tmp_path}", num_envs=3, seed_index=1))
    obs = np.random.default_rng(0).random((3, venv.obs_dim), np.float32)
    a, memory = act(obs, jax.random.PRNGKey(1), memory)
    assert np.asarray(a).shape == (3,) and memory.hidden.shape == (3, 8)
    assert float(np.abs(np.asarray(memory.hidden)).max()) > 0  # the GRU ran
    memory = after_step(memory, np.array([True, False, False]))
    assert np.asarray(memory.reset).tolist() == [True, False, False]
    with pytest.raises(UserError, match="holds 2 seed"):
        load_ppo_policy(tmp_path, 2, seed_index=2)
