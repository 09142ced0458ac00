"""ppo-hidden: the augmented network, hidden-state bookkeeping, and `train ppo-hidden` end to end."""

import json
import logging
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from thinkcraft.cli import main
from thinkcraft.rl.hidden import AugInput, RunningNorm, aux_after_step, make_policy_input, refresh
from thinkcraft.rl.networks import ActorCriticAug


def test_hidden_state_reaches_the_policy():
    net = ActorCriticAug(action_dim=5, layer_width=16, hidden_proj_dim=4)
    rng = np.random.default_rng(0)
    x = AugInput(jnp.asarray(rng.normal(size=(6, 10)), jnp.float32), jnp.asarray(rng.normal(size=(6, 12)), jnp.float32),
                 jnp.zeros(6), jnp.ones(6))
    params = net.init(jax.random.PRNGKey(0), x)

    def loss(p, x):
        pi, v = net.apply(p, x)
        return (pi.log_prob(jnp.arange(6) % 5) + v).sum()

    g = jax.grad(loss)(params, x)["params"]["hidden_proj"]["kernel"]
    assert float(jnp.abs(g).sum()) > 0
    # an invalid hidden state (its episode ended) does not reach the policy at all
    g_masked = jax.grad(loss)(params, x._replace(valid=jnp.zeros(6)))["params"]["hidden_proj"]["kernel"]
    assert float(jnp.abs(g_masked).sum()) == 0
    # ... and changing it changes nothing
    pi_a, _ = net.apply(params, x._replace(valid=jnp.zeros(6)))
    pi_b, _ = net.apply(params, x._replace(valid=jnp.zeros(6), hidden=x.hidden * 3 + 1))
    np.testing.assert_array_equal(np.asarray(pi_a.logits), np.asarray(pi_b.logits))


def test_running_norm_matches_numpy_over_batches():
    rng = np.random.default_rng(1)
    batches = [rng.normal(loc=3.0, scale=s, size=(n, 5)).astype(np.float32) for n, s in [(7, 1.0), (3, 5.0), (20, 0.5)]]
    norm = RunningNorm.create(5)
    for b in batches:
        norm = norm.update(jnp.asarray(b))
    allx = np.concatenate(batches)
    np.testing.assert_allclose(float(norm.count), len(allx))
    np.testing.assert_allclose(np.asarray(norm.mean), allx.mean(0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(norm.var), allx.var(0), rtol=1e-4)
    z = np.asarray(norm.normalize(jnp.asarray(allx)))
    np.testing.assert_allclose(z.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(z.std(0), 1, atol=1e-3)


def test_reset_inside_a_window_masks_the_hidden_state_and_ages_it():
    norm, aux = refresh(RunningNorm.create(3), jnp.ones((4, 3)), jnp.zeros(4, jnp.int32), jnp.ones(4, bool))
    assert aux.valid.all() and (aux.age == 0).all()
    aux = aux_after_step(aux, jnp.array([False, True, False, False]))
    aux = aux_after_step(aux, jnp.array([False, False, False, True]))
    np.testing.assert_array_equal(np.asarray(aux.age), [2, 2, 2, 2])
    np.testing.assert_array_equal(np.asarray(aux.valid), [True, False, True, False])
    x = make_policy_input(4.0)(jnp.zeros((4, 2)), aux)
    np.testing.assert_allclose(np.asarray(x.age), 0.5)
    np.testing.assert_array_equal(np.asarray(x.valid), [1, 0, 1, 0])
    # a refresh makes every env valid again, at the given age
    _, aux = refresh(norm, jnp.ones((4, 3)), jnp.full((4,), 7), jnp.ones(4, bool))
    assert aux.valid.all() and (aux.age == 7).all()


def test_bad_ppo_hidden_config_fails_before_compiling(capsys):
    assert main(["train", "ppo-hidden", "--num-steps", "64", "--skip-n", "25"]) == 2
    err = capsys.readouterr().err
    assert "must divide num_steps=64" in err and "nearest valid" in err
    # an engine that cannot give hidden states (OpenAI-compatible endpoints generate only)
    assert main(["train", "ppo-hidden", "--engine", "openai+http://127.0.0.1:9/v1", "--runs-dir", "/tmp/tc-none",
                 "--overwrite", "--run-name", "x"]) == 2
    assert "cannot return hidden states" in capsys.readouterr().err
    assert main(["train", "ppo-hidden", "--overlap", "--overlap-env-sms", "-1"]) == 2
    assert "--overlap-env-sms: must be >= 0" in capsys.readouterr().err
    assert main(["train", "ppo-hidden", "--engine", "sglang+http://127.0.0.1:9", "--engine-quantize", "fp8"]) == 2
    assert "applies to the in-process hf engine" in capsys.readouterr().err
    assert main(["train", "ppo-hidden", "--engine", "sglang+http://127.0.0.1:9", "--engine-random-weights", "1"]) == 2
    assert "--engine-random-weights: applies to the in-process hf engine" in capsys.readouterr().err
    assert main(["train", "ppo-hidden", "--hidden-input", "zeros", "--engine-random-weights", "1"]) == 2
    assert "--hidden-input: zeros replaces the LLM's hidden states" in capsys.readouterr().err


def test_overlap_partitions_only_an_llm_that_shares_the_policy_gpu():
    from thinkcraft.llm.protocol import Capabilities
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig
    from thinkcraft.train.ppo_hidden.schedule import _partition_for_overlap

    class Engine:
        capabilities = Capabilities(hidden_states=True, generate=False, logprobs=False, prefix_reuse=True,
                                    sm_partition=True, device="cpu")
        calls: list = []

        def set_sm_limit(self, n):
            self.calls.append(n)
            return None

    e = Engine()
    # a CPU engine (or any engine off JAX's GPU) is never partitioned, nor without --overlap or with 0 SMs kept
    assert _partition_for_overlap(e, PPOHiddenConfig(overlap=True)) is None
    assert _partition_for_overlap(e, PPOHiddenConfig(overlap=False)) is None
    assert _partition_for_overlap(e, PPOHiddenConfig(overlap=True, overlap_env_sms=0)) is None
    assert e.calls == []



class _FakeSource:
    """A hidden-state source whose 'hidden states' name the snapshot they were computed from."""

    def __init__(self):
        from thinkcraft.utils.timing import PhaseTimer

        self.timer = PhaseTimer()

    def texts(self, env_state):
        return env_state

    def hidden(self, texts):
        from thinkcraft.train.ppo_hidden.source import FreshHidden

        return FreshHidden(f"h-{texts}", float(len(texts)))


def _fake_state(snapshot, done):
    from types import SimpleNamespace as NS

    return NS(runner=NS(rollout=NS(env_state=snapshot)), done_since_snapshot=jnp.asarray(done))


def test_overlapped_schedule_installs_the_previous_snapshot_one_interval_old():
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig
    from thinkcraft.train.ppo_hidden.schedule import OverlappedRefresh

    installs = []

    def install(state, hidden, age, valid, pool_hidden, keep):
        assert pool_hidden is None and not np.asarray(keep).any()
        installs.append((hidden, int(age), np.asarray(valid).tolist()))
        return state

    # the masked scheme (no reset pool): envs whose episode ended since the snapshot are masked
    cfg = PPOHiddenConfig(num_steps=16, skip_n=8, overlap=True, overlap_env_sms=0, reset_pool_size=0)
    kernels = SimpleNamespace(install=install)
    with OverlappedRefresh(cfg, _FakeSource(), kernels, engine=None) as schedule:
        # the first refresh is synchronous: this snapshot, age 0, every env valid
        assert schedule.before_window(_fake_state("a", [False, True]), 0)[1] is None
        assert installs == [("h-a", 0, [True, True])]
        # later ones install the previous snapshot's, one interval old, masked where an episode ended since
        schedule.before_window(_fake_state("bb", [False, True]), 0)
        assert installs[-1] == ("h-a", 8, [True, False])
        schedule.before_window(_fake_state("ccc", [False, False]), 1)
        assert installs[-1] == ("h-bb", 8, [True, True])
        assert schedule.pop_suffix_tokens() == [1.0, 1.0, 2.0] and schedule.pop_suffix_tokens() == []
    assert schedule._executor._shutdown  # the worker is stopped on exit


def test_sync_schedule_refreshes_at_refresh_points_only():
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig
    from thinkcraft.train.ppo_hidden.schedule import SyncRefresh, make_schedule

    # skip_n = 2 x num_steps: every other update refreshes (before its one window)
    schedule = make_schedule(PPOHiddenConfig(num_steps=16, skip_n=32, reset_pool_size=0), _FakeSource(),
                             kernels=None, engine=None)
    assert isinstance(schedule, SyncRefresh)
    state = _fake_state("a", [False])
    assert schedule.before_window(state, 0) == (state, "h-a")
    assert schedule.before_window(state, 1) == (state, None)
    assert schedule.before_window(state, 2) == (state, "h-a")
    assert schedule.pop_suffix_tokens() == [1.0, 1.0]

TINY = ["--env-name", "craftax-classic", "--num-envs", "8", "--num-steps", "16", "--layer-width", "64",
        "--total-timesteps", "512", "--updates-per-chunk", "2", "--optimistic-reset-ratio", "4", "--no-plot"]


@pytest.mark.slow
def test_skip_n_never_is_plain_ppo_bit_for_bit(tmp_path):
    runs = str(tmp_path)
    assert main(["train", "ppo", *TINY, "--runs-dir", runs, "--run-name", "plain"]) == 0
    assert main(["train", "ppo-hidden", *TINY, "--skip-n", "0", "--runs-dir", runs, "--run-name", "never"]) == 0
    import flax.serialization

    from thinkcraft.train.checkpoint import read_checkpoint

    a, b = (flax.serialization.msgpack_restore(read_checkpoint(tmp_path / n)[0].files["params.msgpack"])
            for n in ("plain", "never"))
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


@pytest.mark.slow
def test_train_ppo_hidden_end_to_end_with_the_bundled_model(tmp_path, caplog, capsys):
    args = ["train", "ppo-hidden", "--env-name", "craftax-classic", "--num-envs", "2", "--num-steps", "8",
            "--skip-n", "4", "--layer-width", "32", "--hidden-proj-dim", "8", "--num-minibatches", "2",
            "--optimistic-reset-ratio", "1", "--total-timesteps", "32", "--layer", "2",
            "--runs-dir", str(tmp_path), "--run-name", "h"]
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        assert main(args) == 0
    # the fused refresh+window (the whole rollout) compiles once, though its state comes from init, from
    # itself and from the PPO update (uncommitted vs committed inputs once made it compile twice): one
    # program-cache line (a miss, or a hit where another run wrote it), one XLA compile or cache read
    err = capsys.readouterr().err
    assert err.count("program cache: ") and err.count("(ppo-hidden-refresh-window") == 1, err[-2000:]
    recs = [json.loads(l) for l in (tmp_path / "h/metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    last = recs[-1]
    for k in ("timing/render", "timing/llm", "timing/env_policy", "timing/update", "sps", "llm/share",
              "hidden/age_mean", "hidden/valid_frac", "llm/prompt_suffix_tokens"):
        assert k in last, k
    assert last["llm/refreshes"] == 2  # two windows of 4 steps per 8-step update
    # 2 updates × 2 refreshes × (2 envs + a reset pool of 2 worlds: num_envs / optimistic_reset_ratio)
    assert last["hidden/norm_count"] == 2 * 2 * (2 + 2)
    assert last["hidden/valid_frac"] == 1.0 and "hidden/pool_draws_per_world" in last
    for k in ("losses/policy", "losses/value", "losses/entropy", "episode/count"):  # learning metrics
        assert k in last, k
    assert 0 < last["llm/share"] < 1
    cfg = json.loads((tmp_path / "h/config.json").read_text())
    assert cfg["_derived"]["hidden_size"] == 576
    assert (tmp_path / "h/curve.png").exists()
    # overlap mode runs too (hidden states one refresh old: age starts at skip_n)
    caplog.clear()
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        # (and the random-weights control engine: same shapes, so no new compile)
        assert main(args[:-2] + ["--run-name", "o", "--overlap", "--engine-random-weights", "3"]) == 0
    assert json.loads((tmp_path / "o/config.json").read_text())["engine_random_weights"] == 3
    # the install of a refresh compiles once: the first (synchronous) refresh and the later ones (one
    # refresh old) pass arrays of the same kind (an uncommitted "all valid" once cost a second compile)
    compiles = [r for r in caplog.records if "Compiling jit(_install)" in r.getMessage()]
    assert len(compiles) == 1, [r.getMessage()[:200] for r in compiles]
    last_o = json.loads((tmp_path / "o/metrics.jsonl").read_text().splitlines()[-1])
    assert last_o["hidden/age_mean"] > last["hidden/age_mean"]
    assert 0 <= last_o["llm/wait_share"] <= 1 and last["llm/wait_share"] == last["llm/share"]
    assert last_o["hidden/valid_frac"] == 1.0
    # the worker's LLM time overlaps the loop's phases and is not subtracted from the loop's wall twice
    assert last_o["timing/other"] >= 0 and last["timing/other"] >= 0


def test_random_weights_engine_keeps_the_shapes_and_draws_seeded_weights(tmp_path):
    """--engine-random-weights: the model's own architecture and tokenizer, weights re-initialised by the
    model's initialiser from the seed (the control arm of bench/llm_features.py)."""
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.protocol import Batch
    from thinkcraft.llm.testing import save_tiny, tiny_llama
    from thinkcraft.train.ppo_hidden.config import PPOHiddenConfig, engine_options

    path = save_tiny(tmp_path / "m", *tiny_llama())
    real = HFEngine(str(path), device="cpu")
    a, b, c = (HFEngine(str(path), device="cpu", random_weights=s) for s in (0, 0, 1))
    sr, sa, sb, sc = (e.model.state_dict() for e in (real, a, b, c))
    assert sr.keys() == sa.keys() and all(sr[k].shape == sa[k].shape and sr[k].dtype == sa[k].dtype for k in sr)
    matrices = [k for k in sr if sr[k].dim() >= 2]
    assert all(torch.equal(sa[k], sb[k]) for k in sr)  # deterministic by seed
    assert all(not torch.equal(sa[k], sr[k]) and not torch.equal(sa[k], sc[k]) for k in matrices)
    assert a.tokenizer.get_vocab() == real.tokenizer.get_vocab() and a.hidden_size == real.hidden_size
    # the torch global RNG is not consumed by the initialisation
    torch.manual_seed(5)
    x = torch.rand(3)
    torch.manual_seed(5)
    HFEngine(str(path), device="cpu", random_weights=7)
    assert torch.equal(torch.rand(3), x)
    batch = Batch(["a tree", "water"], prefix="obs: ")
    assert not np.allclose(a.hidden_states(batch), real.hidden_states(batch))
    assert engine_options(PPOHiddenConfig(engine_random_weights=4))["random_weights"] == 4


def test_refresh_token_path_equals_tokenizing_the_rendered_text():
    """The refresh path renders compact observations straight to token ids; the LLM must see exactly the
    ids of tokenizing the rendered text (and the same hidden states)."""
    from thinkcraft.envs.craftax import make_env
    from thinkcraft.envs.text import extract, render
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.protocol import Batch
    from thinkcraft.llm.testing import tiny_llama
    from thinkcraft.train.ppo_hidden.config import PPOHiddenConfig, make_prompt_prefix
    from thinkcraft.train.ppo_hidden.source import HiddenStateSource
    from thinkcraft.utils.timing import PhaseTimer

    env = make_env("Craftax-Classic-Symbolic-v1", 4, 1)
    _, state = jax.jit(env.reset)(jax.random.PRNGKey(3))
    engine = HFEngine.from_model(*tiny_llama())
    cfg = PPOHiddenConfig(num_envs=4)
    src = HiddenStateSource(engine, cfg, "craftax-classic", PhaseTimer())
    ids = src.texts(state.env_state)
    texts = render(jax.device_get(extract(state.env_state)), fmt="compact", env_kind="craftax-classic")
    _, want = engine.tokenize_batch(Batch(texts, prefix=make_prompt_prefix(cfg)))
    assert ids == want
    got = np.asarray(src.hidden(ids).hidden)
    ref = engine.hidden_states(Batch(texts, prefix=make_prompt_prefix(cfg)))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_zeros_hidden_input_feeds_zeros_of_the_llms_width_without_calling_it():
    """--hidden-input zeros (the llm-features experiment's blank arm): the same rows and width as the LLM's
    hidden states, all zeros, and the engine never asked for hidden states."""
    from thinkcraft.envs.craftax import make_env
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.testing import tiny_llama
    from thinkcraft.train.ppo_hidden.config import PPOHiddenConfig
    from thinkcraft.train.ppo_hidden.source import HiddenStateSource
    from thinkcraft.utils.timing import PhaseTimer

    env = make_env("Craftax-Classic-Symbolic-v1", 4, 1)
    _, state = jax.jit(env.reset)(jax.random.PRNGKey(3))
    engine = HFEngine.from_model(*tiny_llama())

    def never(*a, **k):
        raise AssertionError("the blank arm called the LLM")

    engine.hidden_states = engine.hidden_states_torch = never
    timer = PhaseTimer()
    src = HiddenStateSource(engine, PPOHiddenConfig(num_envs=4, hidden_input="zeros"), "craftax-classic", timer)
    fresh = src.hidden(src.texts(state.env_state))
    h = np.asarray(fresh.hidden)
    assert h.shape == (4, engine.hidden_size) and not h.any() and np.isnan(fresh.suffix_tokens)


@pytest.mark.gpu
def test_llm_on_a_second_gpu_hands_hidden_states_to_the_policy_gpu():
    """--engine-device cuda:1: the LLM's output lands on JAX's first device (torch peer copy + DLPack)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2 or jax.devices()[0].platform != "gpu":
        pytest.skip("needs two CUDA GPUs visible to both torch and JAX (none here)")
    from thinkcraft.train.ppo_hidden.source import to_policy_device

    h = torch.randn(4, 8, device="cuda:1")
    x = to_policy_device(h)
    assert x.devices() == {jax.devices()[0]}
    np.testing.assert_allclose(np.asarray(x), h.cpu().numpy())


@pytest.mark.gpu
def test_overlap_partitions_an_llm_on_the_policy_gpu_and_restores_it():
    if not torch.cuda.is_available() or jax.devices()[0].platform != "gpu":
        pytest.skip("needs a CUDA GPU visible to both torch and JAX (none here)")
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.testing import tiny_llama
    from thinkcraft.train.ppo_hidden import PPOHiddenConfig
    from thinkcraft.train.ppo_hidden.schedule import _partition_for_overlap

    model, tok = tiny_llama()
    engine = HFEngine.from_model(model.to("cuda"), tok)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    restore = _partition_for_overlap(engine, PPOHiddenConfig(overlap=True, overlap_env_sms=16))
    assert restore == (None,) and engine.sm_limit == total - 16
    engine.set_sm_limit(restore[0])
    assert engine.sm_limit is None


def _llm_features():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "llm_features.py"
    spec = importlib.util.spec_from_file_location("llm_features", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["llm_features"] = mod  # (its dataclass resolves annotations through its module)
    spec.loader.exec_module(mod)
    return mod


def test_llm_features_jobs_resume_and_stop_by_the_run_dirs(tmp_path):
    """bench/llm_features.py's plumbing: which process each (env, arm, seed) gets, from the state of its run
    dir (new / died before a checkpoint / part-way / done), one process per run (lock), SIGINT at the limit."""
    import argparse
    import sys
    import time

    lf = _llm_features()
    a = argparse.Namespace(
        envs=["classic", "craftax"], arms=list(lf.ARMS), seeds=3, first_seed=0, seed_mode="separate",
        num_envs=1024, num_steps=50, total_timesteps=20_000_000, skip_n=25, engine="hf:default", extra=[],
        hidden_extra=[], session_flags=["--checkpoint-every-minutes", "3"])
    jobs = lf.make_jobs(a)
    assert len(jobs) == 2 * len(lf.ARMS) * 3 and len({j.name for j in jobs}) == len(jobs)
    by = {j.name: j.argv(a) for j in jobs}
    assert by["classic-ppo-s1"][:2] == ["train", "ppo"] and "--engine" not in by["classic-ppo-s1"]
    assert by["craftax-llm-s2"][:2] == ["train", "ppo-hidden"] and "--engine-random-weights" not in by["craftax-llm-s2"]
    rnd = by["craftax-random-llm-s2"]
    assert rnd[rnd.index("--engine-random-weights") + 1] == "2" and rnd[rnd.index("--seed") + 1] == "2"
    blank = by["classic-blank-s0"]  # the ablation: ppo-hidden, zeros for the hidden states, no random weights
    assert blank[:2] == ["train", "ppo-hidden"] and blank[blank.index("--hidden-input") + 1] == "zeros"
    assert "--engine-random-weights" not in blank and "--hidden-input" not in by["classic-llm-s0"]
    assert lf.DEFAULT_ARMS == ("ppo", "llm", "random-llm")  # the three unless --arm says otherwise
    for argv in by.values():  # every arm: the same env steps, envs and rollout length
        assert [argv[argv.index(f) + 1] for f in ("--num-envs", "--num-steps", "--total-timesteps")] == ["1024", "50", "20000000"]
    if not lf.supports_num_seeds():
        with pytest.raises(SystemExit, match="no --num-seeds yet"):
            lf.make_jobs(argparse.Namespace(**{**vars(a), "seed_mode": "vmapped"}))

    job, run = jobs[0], tmp_path / jobs[0].name
    assert lf.job_state(run)[0] == "new" and "--overwrite" in lf.command_for(job, a, tmp_path)
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"_derived": {"num_updates": 4, "batch_size": 100}}))
    assert lf.job_state(run) == ("broken", 0, 400) and "--overwrite" in lf.command_for(job, a, tmp_path)
    (run / "checkpoint" / "00000002").mkdir(parents=True)
    (run / "checkpoint" / "latest.json").write_text(json.dumps({"env_steps": 200, "update": 2, "checkpoint": "00000002"}))
    assert lf.job_state(run) == ("partial", 200, 400)
    restart = lf.command_for(job, a, tmp_path)  # made for 400 steps a seed, 20M asked: started again
    assert "--overwrite" in restart and "--resume" not in restart
    a = argparse.Namespace(**{**vars(a), "total_timesteps": 400})
    cmd = lf.command_for(job, a, tmp_path)
    assert cmd[cmd.index("thinkcraft") + 1:] == ["train", "ppo", "--resume", "--run-dir", str(run), "--resume-fallback",
                                                 "--checkpoint-every-minutes", "3"]
    (run / "checkpoint" / "latest.json").write_text(json.dumps({"env_steps": 400, "update": 4, "checkpoint": "00000002"}))
    assert lf.job_state(run)[0] == "done" and lf.command_for(job, a, tmp_path) is None

    lock = tmp_path / "x.lock"
    assert lf.take_lock(lock) and not lf.take_lock(lock)  # held by a live process (us)
    lock.write_text("999999999")  # a dead one's: taken over
    assert lf.take_lock(lock)

    # the time limit: the child gets SIGINT (a training run then checkpoints and exits)
    marker = tmp_path / "sigint"
    child = (f"import signal, sys, time, pathlib\n"
             f"signal.signal(signal.SIGINT, lambda *a: (pathlib.Path({str(marker)!r}).write_text('x'), sys.exit(0)))\n"
             f"time.sleep(60)\n")
    t0 = time.time()
    rc = lf.run_child([sys.executable, "-c", child], tmp_path / "c.log", None, deadline=time.time() + 2)
    assert rc == 0 and marker.exists() and time.time() - t0 < 30


def test_llm_features_collect_reproduces_the_published_rows(tmp_path):
    """BENCHMARKS §4b's numbers come from the committed run dirs: `collect` over a copy of them gives the
    committed rows of bench/results/llm_features.json (both envs, every arm, every seed, finished at the same
    steps) and a per-achievement table of every arm (finals only, no curves)."""
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    src = root / "bench" / "results" / "llm_features_runs"
    if not (src / "classic-llm" / "metrics.jsonl.gz").exists():  # archived compressed (utils.metrics)
        pytest.skip("no committed runs in this checkout")
    arms = ("ppo", "llm", "random-llm", "blank")
    runs = tmp_path / "runs"
    for env in ("classic", "craftax"):
        for arm in arms:
            shutil.copytree(src / f"{env}-{arm}", runs / f"{env}-{arm}")
    out = tmp_path / "llm_features.json"
    lf = _llm_features()
    assert lf.main(["collect", "--runs-dir", str(runs), "--results", str(out), "--bootstrap-samples", "200"]) == 0
    got = {(r["env"], r["arm"], r["seed"]): r for r in json.loads(out.read_text())}
    want = {(r["env"], r["arm"], r["seed"]): r
            for r in json.loads((root / "bench" / "results" / "llm_features.json").read_text())}
    assert set(got) == set(want) == {(e, a, s) for e in ("classic", "craftax") for a in arms for s in range(3)}
    for k, w in want.items():
        assert got[k]["finished"] and got[k]["steps"] == w["steps"] == 20_019_200
        assert got[k]["final_return"] == pytest.approx(w["final_return"], rel=1e-9)
    for env, n_achievements in (("classic", 22), ("craftax", 67)):
        ach = json.loads((runs / f"compare-{env}" / "achievements.json").read_text())
        assert {g["label"] for g in ach["groups"]} == set(arms)
        for g in ach["groups"]:
            names = [m for m in g["metrics"] if m.startswith("achievements/") and m != "achievements/mean_rate"]
            assert len(names) == n_achievements, (env, g["label"], len(names))
            assert all("curve" not in m and len(m["finals"]) == 3 for m in g["metrics"].values())
