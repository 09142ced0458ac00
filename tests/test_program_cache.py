"""The traced-program cache (utils/program_cache.py): keys, output structures, hits, misses, corrupt entries,
the off switch; and `train ppo` end to end (slow): a second identical run reads its init and chunk from the
cache and trains bit for bit as the first (and as the uncached program)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

from thinkcraft.rl.ppo import RolloutState, RunnerState
from thinkcraft.train.ppo import PROGRAM_KEY_EXCLUDE, PPOConfig
from thinkcraft.utils import program_cache as pc


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "programs"
    monkeypatch.setenv(pc.ENV_DIR, str(d))
    monkeypatch.delenv(pc.ENV_SWITCH, raising=False)
    return d


def _apply(params, x):
    return x @ params["w"]


TX = optax.adam(1e-2)


def _init(key):
    return TrainState.create(apply_fn=_apply, params={"w": jax.random.normal(key, (4, 3))}, tx=TX)


def _step(ts):
    loss, grads = jax.value_and_grad(lambda p: jnp.square(ts.apply_fn(p, jnp.ones((2, 4)))).mean())(ts.params)
    return ts.apply_gradients(grads=grads), {"loss": loss, "counts": jnp.arange(3)}


def _compile(extra=1):
    key = jax.random.PRNGKey(0)
    init = pc.compile_cached(jax.jit(_init), (key,), name="t-init", key_extra={"x": extra},
                             static_aux={TrainState: (_apply, TX)})
    ts = init(key)
    step = pc.compile_cached(jax.jit(_step), (ts,), name="t-step", donate_argnums=(0,), key_extra={"x": extra})
    return init, step, ts


def test_key_is_stable_and_covers_everything_that_shapes_the_program():
    leaves = [("[0].params['w']", (4, 3), "float32", False, "SingleDeviceSharding(cpu:0)")]
    base = dict(name="chunk", leaf_specs=leaves, key_extra={"a": 1, "b": 2.5}, device=("cpu", 1),
                sources="s" * 64, package_versions={"jax": "0.10.2", "jaxlib": "0.10.2"})
    k = pc.program_key(**base)
    assert k == pc.program_key(**{**base, "key_extra": {"b": 2.5, "a": 1}})  # field order is not part of it
    assert len(k) == 64
    changed = [
        {"name": "init"}, {"key_extra": {"a": 1, "b": 2.6}}, {"device": ("NVIDIA H100", 1)}, {"device": ("cpu", 2)},
        {"sources": "t" * 64}, {"package_versions": {"jax": "0.10.3", "jaxlib": "0.10.2"}},
        {"leaf_specs": [(leaves[0][0], (4, 4), *leaves[0][2:])]},
        {"leaf_specs": [(*leaves[0][:2], "bfloat16", *leaves[0][3:])]},
        {"leaf_specs": [("[0].params['v']", *leaves[0][1:])]},
    ]
    assert len({pc.program_key(**{**base, **c}) for c in changed} | {k}) == len(changed) + 1


def test_config_key_drops_run_only_fields_and_source_hash_is_cached():
    a = pc.program_key_config(PPOConfig(run_name="a", seed=1, plot=False), PROGRAM_KEY_EXCLUDE)
    b = pc.program_key_config(PPOConfig(run_name="b", seed=7, stop_after_updates=0), PROGRAM_KEY_EXCLUDE)
    assert a == b and {"num_envs", "lr", "gamma", "env_name", "unroll_env_scans"} <= set(a)
    assert not {"run_name", "seed", "plot", "runs_dir"} & set(a)
    assert pc.program_key_config(PPOConfig(gamma=0.9), PROGRAM_KEY_EXCLUDE) != a
    assert pc.source_hash() == pc.source_hash() and len(pc.source_hash()) == 64


def test_output_structures_round_trip_through_json():
    ts = jax.eval_shape(_init, jax.random.PRNGKey(0))
    tree = (RunnerState(ts, RolloutState(None, {"a": 1, "b": [2, (3,)]}, None, 4, None), 5), {"m/x": 1, "_y": 2})
    td = jax.tree.structure(tree)
    spec = json.loads(json.dumps(pc.tree_to_json(td)))
    assert pc.tree_from_json(spec, pc.live_nodes([tree])) == td
    assert pc.tree_from_json(spec, pc.live_nodes([], {TrainState: (_apply, TX)})) == td
    with pytest.raises(LookupError):  # TrainState's apply_fn and optimizer are never read from a file
        pc.tree_from_json(spec, {})


def test_second_compile_hits_and_computes_the_same(cache_dir, capsys):
    init1, step1, ts = _compile()
    assert not init1.hit and not step1.hit
    assert len(list(cache_dir.glob("*.jaxexport"))) == len(list(cache_dir.glob("*.json"))) == 2
    out1 = step1(ts)
    assert ts.params["w"].is_deleted()  # donated, as the AOT-compiled chunk's runner
    init2, step2, ts2 = _compile()
    assert init2.hit and step2.hit
    assert isinstance(ts2, TrainState) and ts2.apply_fn is _apply and ts2.tx is TX
    out2 = step2(ts2)
    assert jax.tree.structure(out1) == jax.tree.structure(out2)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out1), jax.tree.leaves(out2)))
    expect = jax.jit(_step)(_init(jax.random.PRNGKey(0)))  # the plain traced program
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(expect), jax.tree.leaves(out2)))
    err = capsys.readouterr().err
    assert err.count("program cache: miss (t-") == 2 and err.count("program cache: hit (t-") == 2


def test_numpy_arguments_share_the_entry_of_device_arrays(cache_dir):
    """A resumed run's state is restored as numpy arrays: the same program as a fresh run's."""
    _, step, ts = _compile()
    ts_np = jax.tree.map(np.asarray, ts)
    again = pc.compile_cached(jax.jit(_step), (ts_np,), name="t-step", donate_argnums=(0,), key_extra={"x": 1})
    assert again.hit and again.key == step.key
    assert np.array_equal(again(ts_np)[0].params["w"], step(ts)[0].params["w"])


def test_changed_key_misses(cache_dir):
    _compile(extra=1)
    init, step, _ = _compile(extra=2)
    assert not init.hit and not step.hit
    assert len(list(cache_dir.glob("*.json"))) == 4


def test_prune_keeps_the_newest_entries_of_one_name(cache_dir):
    for extra in (1, 2, 3):
        _compile(extra)
    pc.prune(cache_dir, "t-step", keep=2)
    assert len(list(cache_dir.glob("t-step-*.json"))) == len(list(cache_dir.glob("t-step-*.jaxexport"))) == 2
    assert len(list(cache_dir.glob("t-init-*.json"))) == 3  # another name's entries are left alone
    assert _compile(3)[1].hit and not _compile(1)[1].hit


@pytest.mark.parametrize("damage", ["truncate", "flip", "json"])
def test_a_corrupt_entry_warns_and_traces_instead(cache_dir, damage):
    _, step1, ts = _compile()
    ref = step1(ts)
    blob = next(cache_dir.glob("t-step-*.jaxexport"))
    if damage == "truncate":
        blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])
    elif damage == "flip":
        b = bytearray(blob.read_bytes())
        b[len(b) // 2] ^= 0xFF
        blob.write_bytes(bytes(b))
    else:
        blob.with_suffix(".json").write_text("{not json")
    with pytest.warns(pc.ProgramCacheWarning, match="cannot use t-step-.*tracing instead"):
        init, step, ts = _compile()
    assert init.hit and not step.hit
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(step(ts))))
    assert _compile()[1].hit  # the entry was written again


def test_off_switch(cache_dir, monkeypatch, capsys):
    monkeypatch.setenv(pc.ENV_SWITCH, "0")
    init, step, ts = _compile()
    assert not isinstance(step, pc.CachedProgram) and not cache_dir.exists()
    assert "program cache: off (t-step: disabled by THINKCRAFT_PROGRAM_CACHE)" in capsys.readouterr().err
    assert np.isfinite(float(step(ts)[1]["loss"]))


TINY = [
    "--env-name", "craftax-classic", "--num-envs", "8", "--num-steps", "16", "--layer-width", "64",
    "--total-timesteps", "65536", "--updates-per-chunk", "2", "--optimistic-reset-ratio", "4",
    "--stop-after-updates", "4", "--no-plot",
]  # test_train_ppo.py's shapes: the uncached programs are in the shared XLA cache already


@pytest.mark.slow
def test_train_ppo_second_run_reads_the_programs_and_trains_identically(tmp_path, cache_dir, monkeypatch, capsys):
    from test_train_ppo import _params, _same

    from thinkcraft.cli import main

    def run(name):
        assert main(["train", "ppo", *TINY, "--run-dir", str(tmp_path / name)]) == 0
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        recs = [{k: v for k, v in json.loads(x).items() if not k.startswith("timing") and k not in ("time_s", "sps")}
                for x in lines]
        return recs, _params(tmp_path / name)[0], capsys.readouterr().err

    monkeypatch.setenv(pc.ENV_SWITCH, "0")
    recs0, params0, err0 = run("plain")
    assert "program cache: off (ppo-chunk" in err0
    monkeypatch.setenv(pc.ENV_SWITCH, "1")
    recs1, params1, err1 = run("first")
    assert "program cache: miss (ppo-init" in err1 and "program cache: miss (ppo-chunk" in err1
    assert "saved)" in err1 and "not saved" not in err1
    recs2, params2, err2 = run("second")
    assert "program cache: hit (ppo-init" in err2 and "program cache: hit (ppo-chunk" in err2
    assert len(recs1) == 2 and recs1 == recs2 and _same(params1, params2)
    assert recs0 == recs1 and _same(params0, params1)  # the exported program is the traced one


@pytest.mark.slow
def test_train_ppo_hidden_second_run_reads_its_kernels_and_trains_identically(tmp_path, cache_dir, capsys):
    """ppo-hidden's loop-called kernels (pool, refresh + window, update) are compiled through the cache at
    their first call: a second identical run reads every one of them and trains bit for bit as the first."""
    import torch
    from test_feature_engines import TINY as HIDDEN_TINY
    from test_train_ppo import _params, _same

    from thinkcraft.cli import main
    from thinkcraft.llm.testing import save_tiny, tiny_llama

    torch.manual_seed(0)
    model = save_tiny(tmp_path / "model", *tiny_llama())
    names = ("ppo-hidden-pool", "ppo-hidden-refresh-window", "ppo-hidden-update")

    def run(name):
        assert main(["train", "ppo-hidden", *HIDDEN_TINY, "--engine", f"hf:{model}", "--run-dir",
                     str(tmp_path / name)]) == 0
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        recs = [{k: v for k, v in json.loads(x).items()
                 if not k.startswith(("timing", "llm/")) and k not in ("time_s", "sps")} for x in lines]
        return recs, _params(tmp_path / name)[0], capsys.readouterr().err

    recs1, params1, err1 = run("first")
    assert all(f"program cache: miss ({n}" in err1 for n in names), err1[-3000:]
    recs2, params2, err2 = run("second")
    assert all(f"program cache: hit ({n}" in err2 for n in names), err2[-3000:]
    assert len(recs1) == 2 and recs1 == recs2 and _same(params1, params2)
