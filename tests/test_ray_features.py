"""ppo-hidden's feature engines as Ray actors (pools/ray_features.py, `--ray-feature-engines`, issue 21 item 2)
on a local Ray that this module starts (2 CPUs), a tiny random model saved to disk: the actors' rows equal one
in-process engine's, in the batch's order; a killed actor is replaced and its shard retried; the CLI trains
with them; bad combinations are one-line errors before anything compiles."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from thinkcraft.cli import main
from thinkcraft.llm.hf import HFEngine
from thinkcraft.llm.protocol import Batch
from thinkcraft.llm.testing import save_tiny, tiny_llama

SRC = Path(__file__).resolve().parents[1] / "src"
TINY = ["--env-name", "craftax-classic", "--num-envs", "2", "--num-steps", "8", "--skip-n", "4", "--layer-width",
        "32", "--hidden-proj-dim", "8", "--num-minibatches", "2", "--optimistic-reset-ratio", "1",
        "--total-timesteps", "32", "--no-plot"]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install thinkcraft[ray])")
    from thinkcraft.pools.ray_backend import connect

    assert connect("", env_vars={"PYTHONPATH": str(SRC)}, num_cpus=2, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model", *tiny_llama())


def _features(model_dir: Path, k: int = 2, **kw):
    from thinkcraft.pools.ray_features import ray_feature_engine
    from thinkcraft.train.ppo_hidden.config import feature_engine_on

    return ray_feature_engine(functools.partial(feature_engine_on, f"hf:{model_dir}", {}), k, **kw)


def _batch(n: int) -> Batch:
    return Batch(items=[[5 + i, 6, 7 + 2 * i][: 1 + i % 3] for i in range(n)], prefix=[1, 2, 3])


def test_ray_feature_engines_gather_every_row_in_the_batch_order(ray_cluster, model_dir):
    """Two actors: the gathered (N, H) equals one local engine's rows for N above, at and below K; text
    batches are tokenized here with the actors' tokenizer, exactly as the local engine does."""
    one = HFEngine(str(model_dir), device="cpu")
    eng = _features(model_dir)
    try:
        caps = eng.capabilities
        assert caps.hidden_states and caps.hidden_size == 64 and caps.tokenizer and not caps.generate
        for n in (5, 2, 1):
            torch.testing.assert_close(eng.hidden_states_torch(_batch(n)), one.hidden_states_torch(_batch(n)),
                                       atol=1e-5, rtol=1e-5)
        texts = Batch(items=["tree (0,+1)", "water", "cow"], prefix="Observation:\n")
        assert eng.tokenize_batch(texts) == one.tokenize_batch(texts)
        np.testing.assert_allclose(eng.hidden_states(texts), one.hidden_states(texts), atol=1e-5)
        assert eng.calls >= 4 and all(s > 0 for s in eng.shard_s) and eng.restarts == 0
    finally:
        eng.close()
    assert ray_cluster.is_initialized()  # a Ray this module started is not stopped by the engine


def test_a_killed_ray_feature_actor_is_replaced_and_its_shard_retried(ray_cluster, model_dir):
    eng = _features(model_dir, timeout_s=120.0, retries=1)
    try:
        want = eng.hidden_states_torch(_batch(4))
        ray_cluster.kill(eng.engines[1].actor, no_restart=True)
        got = eng.hidden_states_torch(_batch(4))
        torch.testing.assert_close(got, want)
        assert eng.restarts == 1
    finally:
        eng.close()


def test_train_ppo_hidden_with_ray_feature_engines(ray_cluster, model_dir, tmp_path, capsys):
    """The CLI, two actors and --overlap: the run says where its features come from, trains, and every
    refresh's hidden input is valid."""
    assert main(["train", "ppo-hidden", *TINY, "--engine", f"hf:{model_dir}", "--ray-feature-engines", "2",
                 "--overlap", "--runs-dir", str(tmp_path), "--run-name", "ray"]) == 0
    assert "x 2 Ray actors" in capsys.readouterr().err  # (the console writes to stderr)
    recs = [json.loads(line) for line in (tmp_path / "ray/metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and recs[-1]["llm/refreshes"] == 2 and recs[-1]["hidden/valid_frac"] == 1.0
    assert np.isfinite(recs[-1]["losses/total"])


def test_each_actor_gets_a_gpu_or_an_even_share_of_too_few():
    from thinkcraft.pools.ray_features import gpus_per_actor

    assert gpus_per_actor(3.0, 3) == 1.0 and gpus_per_actor(8.0, 3) == 1.0
    assert gpus_per_actor(1.0, 2) == 0.5 and gpus_per_actor(0.0, 2) == 0.0


def test_ray_feature_engines_config_checks(capsys, monkeypatch):
    base = ["train", "ppo-hidden", *TINY]
    assert main([*base, "--ray-feature-engines", "2", "--feature-devices", "cpu", "cpu"]) == 2
    assert "replaces --feature-devices" in capsys.readouterr().err
    assert main([*base, "--ray-feature-engines", "2", "--engine", "sglang+http://127.0.0.1:9"]) == 2
    assert "runs in-process hf engines in the actors" in capsys.readouterr().err
    assert main([*base, "--ray-address", "127.0.0.1:6379"]) == 2
    assert "give their number too" in capsys.readouterr().err
    assert main([*base, "--ray-feature-engines", "-1"]) == 2
    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # as where Ray is not installed
    assert main([*base, "--ray-feature-engines", "2"]) == 2
    err = capsys.readouterr().err
    assert "--ray-feature-engines needs Ray" in err and "pip install thinkcraft[ray]" in err
