"""`train llm-policy --mode async` end to end on tiny random models (CPU): η = 0 is the synchronous loop,
η = 1 keeps its bound and trains every group exactly once, dynamic sampling, the config's checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from test_llm_policy import _ParityReward

from thinkcraft.envs.textenvs import ArithTask, RewardResult
from thinkcraft.envs.textenvs import TaskEnv
from thinkcraft.train import llm_policy as LP
from thinkcraft.utils.errors import ConfigError
from thinkcraft.utils.metrics import read_metrics


def _cfg(tmp_path, **kw):
    base = dict(model="random:tiny", run_dir=str(tmp_path / "run"), steps=2, prompts_per_step=2, group_size=3,
                max_new_tokens=8, micro_batch_size=4, lr=1e-2, plot=False, log_every_s=1e9)
    base.update(kw)
    return LP.LLMPolicyConfig(**base)


def patch_reward(monkeypatch):
    """The same parity reward in the sync loop's env and the async workers' (thread) envs."""
    import thinkcraft.pools.envproc as envproc
    import thinkcraft.train.llm_policy.loop as loop

    env = lambda *a, **k: TaskEnv(ArithTask(1), _ParityReward())  # noqa: E731 - (cfg, judge=None) / (spec)
    monkeypatch.setattr(loop, "make_env_and_reward", env)
    monkeypatch.setattr(envproc.EnvSpec, "build", lambda self: env())


def journal(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "consumed.jsonl").read_text().splitlines()]


def ckpt(run_dir) -> dict:
    """The newest verified checkpoint's state."""
    from thinkcraft.train.checkpoint import TORCH_CODEC, read_checkpoint

    cp, _ = read_checkpoint(Path(run_dir))
    return TORCH_CODEC.decode(cp.files, None)


def lora(run_dir):
    st = ckpt(run_dir)
    return st["step"], dict(st["trainable"])


def store_records(run_dir):
    from thinkcraft.data.reader import read_table
    from thinkcraft.data.schema import table_to_records

    return table_to_records(read_table(Path(run_dir) / "trajectories"))


def _same_runs(sync, asy, n_records: int) -> None:
    """The two runs' trajectories (token ids, logprobs, rewards) and updates (LoRA weights, losses) agree."""
    key = lambda r: (r.metadata.policy_version, r.task_id, r.metadata.extra["group"],  # noqa: E731
                     r.turns[0].response_token_ids.tobytes())
    a, b = sorted(store_records(sync.run_dir), key=key), sorted(store_records(asy.run_dir), key=key)
    assert len(a) == len(b) == n_records
    for x, y in zip(a, b):
        assert x.task_id == y.task_id and x.metadata.policy_version == y.metadata.policy_version
        assert len(x.turns) == len(y.turns)
        for tx, ty in zip(x.turns, y.turns):
            assert np.array_equal(tx.prompt_token_ids, ty.prompt_token_ids)
            assert np.array_equal(tx.response_token_ids, ty.response_token_ids)
            np.testing.assert_allclose(tx.logprobs, ty.logprobs, atol=1e-6)
            assert tx.reward == ty.reward
    (sa, wa), (sb, wb) = lora(sync.run_dir), lora(asy.run_dir)
    assert sa == sb == sync.steps
    assert any(v.abs().sum() > 0 for n, v in wa.items() if "lora_B" in n)
    # the sync loop's engine runs episodes through continuous batching (the system prompt's KV shared, an
    # episode's KV kept between turns), the front's batches through `generate`: the same tokens, log-probs equal
    # within fp32 rounding (above), so the gradients agree to ~1e-7 and the weights to ~1e-5 - but for the odd
    # element whose gradient is near 0, where Adam's g / (|g| + eps) turns rounding into up to lr: compared per
    # tensor (a wrong update moves every element by ~lr = 1e-2, a relative change ~1e-1)
    for n in wa:
        rel = float((wb[n] - wa[n]).norm() / wa[n].norm())
        assert rel < 1e-3, (n, rel)
    ms = [json.loads(x) for x in (Path(sync.run_dir) / "metrics.jsonl").read_text().splitlines()]
    ma = [json.loads(x) for x in (Path(asy.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["losses/loss"] for m in ms] == pytest.approx([m["losses/loss"] for m in ma], abs=1e-6)
    assert [m["losses/grad_norm"] for m in ms] == pytest.approx([m["losses/grad_norm"] for m in ma], rel=1e-5)


@pytest.mark.slow
def test_eta_zero_reproduces_the_synchronous_loop_multi_turn(tmp_path, monkeypatch):
    """A 3-turn env (every episode's turns batched across the group workers as the sync loop batches them)."""
    import thinkcraft.pools.envproc as envproc
    import thinkcraft.train.llm_policy.loop as loop
    from test_llm_policy import CountdownEnv

    monkeypatch.setattr(loop, "make_env_and_reward", lambda *a, **k: CountdownEnv())
    monkeypatch.setattr(envproc.EnvSpec, "build", lambda self: CountdownEnv())
    sync = _cfg(tmp_path / "sync", steps=2, group_size=2, max_new_tokens=4)
    LP.run(sync)
    asy = _cfg(tmp_path / "async", steps=2, group_size=2, max_new_tokens=4, mode="async", max_staleness=0,
               rollout_workers=2, gen_batching="whole", gen_batch_wait_ms=60_000)
    LP.run(asy)
    _same_runs(sync, asy, 2 * 2 * 2)


@pytest.mark.slow
def test_eta_zero_reproduces_the_synchronous_loop(tmp_path, monkeypatch):
    patch_reward(monkeypatch)
    sync = _cfg(tmp_path / "sync", steps=3)
    LP.run(sync)
    # 4 workers for 2 prompts: every group starts at once, the engine batches on all waiting episodes
    asy = _cfg(tmp_path / "async", steps=3, mode="async", max_staleness=0, rollout_workers=4,
               gen_batching="whole", gen_batch_wait_ms=60_000)
    last = LP.run(asy)
    assert last["policy_version"] == 3 and last["staleness/max"] == 0
    _same_runs(sync, asy, 3 * 2 * 3)


@pytest.mark.slow
def test_eta_one_bound_journal_metrics_and_store(tmp_path, monkeypatch):
    patch_reward(monkeypatch)
    cfg = _cfg(tmp_path, steps=4, mode="async", max_staleness=1, rollout_workers=3, offpolicy="tis",
               checkpoint_every=2)
    last = LP.run(cfg)
    assert last["policy_version"] == 4 and last["staleness/max"] <= 1
    for k in ("staleness/mean", "staleness/hist_0", "staleness/hist_1", "queue/rollout_queued", "queue/buffer_groups",
              "pool/rollout_busy", "pool/train_busy", "engine/idle_share", "gpu/idle_share", "rollout/failed",
              "offpolicy/weight_mean", "perf/samples_per_s", "timing/train", "perf/gil_lag_max_s"):
        assert k in last, k
    assert 0.0 <= last["engine/idle_share"] <= 1.0 and 0.0 <= last["gpu/idle_share"] <= 1.0
    assert 0.0 <= last["perf/gil_lag_max_s"] < 30.0  # the probe ran (utils.watchdog.GilProbe)
    # the updates' timeline: each began after the previous one ended, and ended after it began
    from thinkcraft.utils.metrics import read_metrics

    recs = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    ends = [r["timeline/end_s"] for r in recs]
    starts = [r["timeline/train_start_s"] for r in recs]
    assert all(0.0 <= s <= e for s, e in zip(starts, ends)) and all(s >= e - 1e-6 for s, e in zip(starts[1:], ends))
    j = journal(cfg.run_dir)
    groups = [g for line in j for g in line["groups"]]
    assert [line["step"] for line in j] == [1, 2, 3, 4] and all(len(line["groups"]) == 2 for line in j)
    assert len(groups) == len(set(groups)) == 8  # nothing trained twice
    assert all(s <= 1 for line in j for s in line["staleness"])
    ids = [t for line in j for t in line["traj_ids"]]
    assert len(ids) == len(set(ids)) == 24
    recs = store_records(cfg.run_dir)
    assert sorted(r.metadata.extra["traj_id"] for r in recs) == sorted(ids)
    # `--resume --run-dir D --steps 5` alone continues the async run as async (the saved mode stands)
    last = LP.run(LP.LLMPolicyConfig(run_dir=cfg.run_dir, resume=True, steps=5))
    assert last["policy_version"] == 5 and "staleness/mean" in last
    j = journal(cfg.run_dir)
    assert [line["step"] for line in j] == [1, 2, 3, 4, 5]
    ids = [t for line in j for t in line["traj_ids"]]
    assert len(ids) == len(set(ids)) == 30
    assert sorted(r.metadata.extra["traj_id"] for r in store_records(cfg.run_dir)) == sorted(ids)


@pytest.mark.slow
def test_dynamic_sampling_drops_groups_without_signal(tmp_path, monkeypatch):
    import thinkcraft.pools.envproc as envproc

    class OddSeedsAgree:
        """Groups of odd seeds all score 1 (no signal); even seeds by completion parity."""

        def __call__(self, problems, completions):
            return [RewardResult(reward=1.0 if p.meta["seed"] % 2 else float(len(c) % 2), correct=False,
                                 format_ok=True) for p, c in zip(problems, completions)]

        def counters(self):
            return {}

    monkeypatch.setattr(envproc.EnvSpec, "build", lambda self: TaskEnv(ArithTask(1), OddSeedsAgree()))
    cfg = _cfg(tmp_path, steps=2, mode="async", dynamic_sampling=True, rollout_workers=2, group_size=4)
    last = LP.run(cfg)
    assert last["dynamic/dropped_groups"] >= 1
    for line in journal(cfg.run_dir):
        seeds = [LP._seed_of(cfg, g // 2 + 1, g % 2) for g in line["groups"]]
        assert all(s % 2 == 0 for s in seeds)  # only groups with a signal were trained
    state = ckpt(cfg.run_dir)["extra"]["async"]
    assert state["dropped"] and not set(state["dropped"]) & set(state["consumed"])


@pytest.mark.parametrize("kw,field", [
    (dict(max_staleness=2), "max-staleness"),  # async-only field without --mode async
    (dict(mode="async", max_staleness=-1), "max-staleness"),
    (dict(mode="async", rollout_workers=0), "rollout-workers"),
    (dict(mode="async", dynamic_sampling=True, algo="apo"), "dynamic-sampling"),
    (dict(mode="async", rollout_devices="gpu0"), "rollout-devices"),
    (dict(mode="async", rollout_servers="http://x:1"), "rollout-servers"),
    (dict(offpolicy="tis", offpolicy_cap=0.0), "offpolicy-cap"),
    (dict(mode="async", action_format="json", max_new_tokens=64, rollout_servers="thinkcraft+http://x:1"),
     "action-format"),  # HTTP engines do not constrain decoding to the grammar
    (dict(gen_batching="whole"), "gen-batching"),  # async-only
    (dict(mode="async", rollout_api_key_env="HOME"), "rollout-api-key-env"),  # no --rollout-servers
    (dict(mode="async", rollout_servers="thinkcraft+http://x:1", rollout_api_key_env="TC_NO_SUCH_VAR"),
     "rollout-api-key-env: environment variable TC_NO_SUCH_VAR"),
])
def test_async_config_rejects_bad_values(tmp_path, kw, field):
    with pytest.raises(ConfigError, match=field):
        _cfg(tmp_path, **kw)


def test_a_rollout_gpu_the_machine_lacks_is_said_before_the_model_loads(tmp_path, monkeypatch):
    import thinkcraft.train.llm_policy.loop as loop

    def never(*a, **k):
        raise AssertionError("the model loaded before the devices were checked")

    monkeypatch.setattr(loop, "load_policy", never)
    with pytest.raises(ConfigError, match="rollout-devices: .*'cuda:64'"):  # no machine here has 65 GPUs
        LP.run(_cfg(tmp_path, mode="async", rollout_devices="cpu,cuda:64"))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(weight_sync="copy"), dict(rollout_devices="cpu,cpu")])
def test_copy_engines_follow_the_learner(tmp_path, monkeypatch, kw):
    """An engine on its own copy of the weights (and two engines, the second a copy: the two-GPU layout on
    CPU) takes each published version; versions and the staleness bound hold."""
    patch_reward(monkeypatch)
    cfg = _cfg(tmp_path, steps=3, mode="async", max_staleness=1, rollout_workers=3, **kw)
    last = LP.run(cfg)
    assert last["policy_version"] == 3 and last["staleness/max"] <= 1
    assert last["engine/min_version"] >= 2 and last["weights/update_failures"] == 0
    # the copy engine's weight-update time is a metric (the shared engine's free updates are left out)
    recs = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    assert any(r.get("weights/update_s", 0) > 0 for r in recs)
    j = journal(cfg.run_dir)
    groups = [g for line in j for g in line["groups"]]
    assert len(groups) == len(set(groups)) == 6


def test_continuous_front_keeps_turn_kv_and_is_on_policy_at_eta_zero(tmp_path, monkeypatch):
    """--gen-batching continuous on a 3-turn env: a group's turns stay on the engine, which keeps each
    episode's KV between turns (prefill saved) while other groups' turns join the running batch; at η = 0 every
    token is the current policy's, so the learner's recomputed log-probs equal the engine's (ratio 1): the
    reused KV and the token-in/token-out prompts are the ones the learner trains on."""
    import thinkcraft.pools.envproc as envproc
    from test_llm_policy import CountdownEnv

    monkeypatch.setattr(envproc.EnvSpec, "build", lambda self: CountdownEnv())
    cfg = _cfg(tmp_path, steps=2, group_size=2, max_new_tokens=4, mode="async", max_staleness=0, rollout_workers=2,
               gen_batching="continuous")
    LP.run(cfg)
    ms = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in ms] == [1, 2]
    for m in ms:
        assert m["losses/ratio"] == pytest.approx(1.0, abs=1e-4) and m["staleness/max"] == 0
        assert m["kv/turn_reuse_saved_frac"] > 0.2 and m["kv/template_fallbacks"] == 0
        assert m["episode/turns"] == 3
        assert m["engine/decode_step_ms"] > 0 and m["engine/rows_per_decode_step"] >= 1  # the slot's engine
        assert m["engine/host_length_ends"] == 0
    ids = [i for line in journal(cfg.run_dir) for i in line["traj_ids"]]
    assert len(ids) == len(set(ids)) == 2 * 2 * 2


def test_async_json_answers_are_valid_and_on_policy(tmp_path):
    """--action-format json in the async pools (continuous engine, η = 1): every answer parses (constrained
    decoding in the workers' turns), and the learner's constrained log-probs match the engine's."""
    from thinkcraft.envs.textenvs.jsonformat import ANSWER_KEY, max_answer_tokens, parse_answer

    cfg = _cfg(tmp_path, steps=2, mode="async", max_staleness=0, rollout_workers=2, action_format="json",
               action_reason_chars=8, max_new_tokens=max_answer_tokens(None, 8))
    LP.run(cfg)
    ms = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert len(ms) == 2
    for m in ms:
        assert m["format/invalid_rate"] == 0.0 and m["losses/ratio"] == pytest.approx(1.0, abs=1e-4)
    acts = [t.act for rec in store_records(cfg.run_dir) for t in rec.turns]
    assert len(acts) == 2 * 2 * 3 and all(parse_answer(a, ANSWER_KEY) is not None for a in acts)
