"""Faults of the asynchronous llm-policy loop (CPU, tiny random models). Each test asserts that nothing is
lost and nothing is trained twice: with η = 0 the groups trained are exactly 0 .. steps·P − 1, each once
(`consumed.jsonl`), whatever failed on the way; the failure is counted under its reason."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from thinkcraft.envs.textenvs import ArithTask
from thinkcraft.envs.textenvs import TaskEnv
from thinkcraft.train import llm_policy as LP
from thinkcraft.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _cfg(tmp_path, **kw):
    base = dict(model="random:tiny", run_dir=str(tmp_path / "run"), steps=3, prompts_per_step=2, group_size=2,
                max_new_tokens=6, micro_batch_size=4, lr=1e-2, plot=False, log_every_s=1e9, mode="async",
                max_staleness=0, rollout_workers=2, checkpoint_every=1)
    base.update(kw)
    return LP.LLMPolicyConfig(**base)


def _ckpt(run_dir) -> dict:
    from thinkcraft.train.checkpoint import TORCH_CODEC, read_checkpoint

    cp, _ = read_checkpoint(Path(run_dir))
    return TORCH_CODEC.decode(cp.files, None)


def _journal(run_dir) -> list[dict]:
    p = Path(run_dir) / "consumed.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def assert_exactly_once(run_dir, steps: int, prompts: int = 2) -> None:
    j = _journal(run_dir)
    assert [line["step"] for line in j] == list(range(1, steps + 1))
    groups = [g for line in j for g in line["groups"]]
    assert sorted(groups) == list(range(steps * prompts)), groups  # none lost, none twice
    ids = [t for line in j for t in line["traj_ids"]]
    assert len(ids) == len(set(ids))


def _when(pred, timeout_s=300.0, every_s=0.05) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return True
        time.sleep(every_s)
    return False


def _env_crashes(run_dir) -> float:
    p = Path(run_dir) / "metrics.jsonl"
    lines = p.read_text().splitlines() if p.exists() else []
    return max((json.loads(x).get("rollout/failed/env_crashed", 0) for x in lines), default=0)


def test_env_worker_killed_mid_episode(tmp_path):
    # 2 s env steps: an env is inside a step most of the time; many attempts per group: the killer may strike one
    # group's env more than once (below)
    cfg = _cfg(tmp_path, env_workers="process", env_latency_ms=2000, max_group_attempts=20)
    killed, done = [], threading.Event()

    def killer():
        # An env killed between two groups restarts silently at the next reset (nothing of a group was lost);
        # with η = 0 the workers wait for the learner between groups, and on a loaded machine that is where a
        # kill may land: kill again (a second later) until an update reports a group that lost its env.
        if not _when(lambda: any(p.name == "thinkcraft-env" for p in mp.active_children())):
            return
        while not done.is_set() and len(killed) < 10 and not _env_crashes(cfg.run_dir):
            time.sleep(2.0)  # startup done (imports, reset, a first generate): the child is inside a step
            victims = [p for p in mp.active_children() if p.name == "thinkcraft-env"]
            if victims and not done.is_set():
                os.kill(victims[0].pid, signal.SIGKILL)
                killed.append(victims[0].pid)
                _when(lambda: done.is_set() or _env_crashes(cfg.run_dir) > 0, timeout_s=6.0)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        last = LP.run(cfg)
    finally:
        done.set()
    t.join(5)
    assert killed and last["rollout/failed/env_crashed"] >= 1 and last["rollout/restarts"] >= 1
    assert_exactly_once(cfg.run_dir, 3)


def test_env_step_hanging_past_its_timeout(tmp_path, monkeypatch):
    import thinkcraft.pools.envproc as envproc
    from thinkcraft.envs.textenvs import RuleReward

    hung = threading.Event()

    class HangsOnce(TaskEnv):
        def step(self, actions):
            if not hung.is_set():
                hung.set()
                time.sleep(3.0)  # far past the 0.5 s step timeout
            return super().step(actions)

    monkeypatch.setattr(envproc.EnvSpec, "build", lambda self: HangsOnce(ArithTask(1), RuleReward()))
    cfg = _cfg(tmp_path, env_step_timeout_s=0.5)
    last = LP.run(cfg)
    assert hung.is_set() and last["rollout/failed/env_step_timeout"] == 1
    assert_exactly_once(cfg.run_dir, 3)


def test_judge_returning_garbage_or_failing(tmp_path, monkeypatch):
    from thinkcraft.envs.textenvs import JudgeReward

    calls = []
    original = JudgeReward.__call__

    def flaky(self, problems, completions):
        calls.append(len(problems))
        if len(calls) == 1:
            raise ConnectionError("injected: judge server hung up")
        return original(self, problems, completions)

    monkeypatch.setattr(JudgeReward, "__call__", flaky)
    # the judge is the random-weight policy itself (adapter off): its verdicts are garbage -> 0 and counted
    cfg = _cfg(tmp_path, reward="judge", judge_engine="self", format_weight=0.0)
    last = LP.run(cfg)
    assert last["rollout/failed/reward_error"] >= 1  # the failed judge call: its groups were played again
    assert last["judge/calls"] >= 3 * 2 * 2 and last["judge/unparsed"] >= 1
    assert_exactly_once(cfg.run_dir, 3)


@pytest.fixture
def tiny_dir(tmp_path):
    from thinkcraft.llm.testing import save_tiny, tiny_llama

    return save_tiny(tmp_path / "model", *tiny_llama())


def test_engine_returning_5xx_and_a_weight_update_failing_half_way(tmp_path, tiny_dir, servers, monkeypatch):
    from thinkcraft.llm.clients import ThinkcraftWeightsClient
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.serve import FaultConfig, make_app

    served = HFEngine(str(tiny_dir))
    # every 4th request fails with 503 (generation and weight loads alike); the client retries them
    url = servers.app(make_app(served, "tiny", faults=FaultConfig(fail_every=4, fail_status=503)))
    torn = []
    original = ThinkcraftWeightsClient.update_weights

    def tear_once(self, path, version, kind):
        if version == 2 and not torn:  # the learner's file is cut in half before the server reads it
            data = Path(path).read_bytes()
            Path(path).write_bytes(data[: len(data) // 2])
            torn.append(version)
        return original(self, path, version, kind)

    monkeypatch.setattr(ThinkcraftWeightsClient, "update_weights", tear_once)
    cfg = _cfg(tmp_path, model=str(tiny_dir), rollout_servers=f"thinkcraft+{url}", max_staleness=1, steps=4)
    last = LP.run(cfg)
    assert torn == [2] and last["weights/update_failures"] >= 1
    assert last["staleness/max"] <= 1 and last["policy_version"] == 4
    j = _journal(cfg.run_dir)
    groups = [g for line in j for g in line["groups"]]
    assert len(groups) == len(set(groups)) == 8 and all(s <= 1 for line in j for s in line["staleness"])
    assert served.model is not None and max(0, 4 - 1) <= _served_version(url) <= 4


def _served_version(url: str) -> int:
    from thinkcraft.llm.clients import ThinkcraftWeightsClient

    return ThinkcraftWeightsClient(url).weights_version()  # through the client: injected 503s are retried


def test_engine_dying_stops_cleanly_and_resumes_elsewhere(tmp_path, tiny_dir, servers):
    url = servers.serve("--model", str(tiny_dir))
    cfg = _cfg(tmp_path, model=str(tiny_dir), rollout_servers=f"thinkcraft+{url}", steps=4, max_group_attempts=50,
               rollout_timeout_s=20)

    def kill_after_first_update():
        if _when(lambda: len(_journal(cfg.run_dir)) >= 1):
            servers.stop_process(url)

    t = threading.Thread(target=kill_after_first_update, daemon=True)
    t.start()
    with pytest.raises(UserError, match="in a row.*checkpoint is intact"):  # weight load or generation
        LP.run(cfg)
    t.join(5)
    done = len(_journal(cfg.run_dir))
    assert 1 <= done < 4 and _ckpt(cfg.run_dir)["step"] == done
    url2 = servers.serve("--model", str(tiny_dir))  # the engine is back (elsewhere): resume there
    last = LP.run(_cfg(tmp_path, model=str(tiny_dir), rollout_servers=f"thinkcraft+{url2}", steps=4, resume=True))
    assert last["policy_version"] == 4
    assert_exactly_once(cfg.run_dir, 4)


def _cli(run_dir, *extra):
    args = [sys.executable, "-m", "thinkcraft", "train", "llm-policy", "--mode", "async", "--model", "random:tiny",
            "--run-dir", str(run_dir), "--steps", "5", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "6", "--micro-batch-size", "4", "--max-staleness", "1", "--rollout-workers", "2",
            "--checkpoint-every", "1", "--no-plot", "--log-every-s", "1000", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _trained_once(run_dir, steps=5) -> None:
    j = _journal(run_dir)
    assert [line["step"] for line in j] == list(range(1, steps + 1))
    groups = [g for line in j for g in line["groups"]]
    assert len(groups) == len(set(groups)) == 2 * steps  # nothing trained twice (η = 1: ids may skip ahead)
    st = _ckpt(run_dir)
    assert st["step"] == steps and sorted(st["extra"]["async"]["consumed"]) == sorted(groups)
    from thinkcraft.data.reader import read_table
    from thinkcraft.data.schema import table_to_records

    ids = [r.metadata.extra["traj_id"] for r in table_to_records(read_table(Path(run_dir) / "trajectories"))]
    assert len(ids) == len(set(ids)) == 2 * 2 * steps  # the store too: every trained trajectory once


def test_learner_process_killed_and_resumed(tmp_path):
    run_dir = tmp_path / "run"
    p = _cli(run_dir)
    assert _when(lambda: len(_journal(run_dir)) >= 2 or p.poll() is not None), "no progress"
    p.send_signal(signal.SIGKILL)  # kill -9: no handler, no cleanup
    p.wait(30)
    assert 2 <= len(_journal(run_dir)) < 5
    p2 = _cli(run_dir, "--resume")
    out, _ = p2.communicate(timeout=600)
    assert p2.returncode == 0, out[-3000:]
    _trained_once(run_dir)


def test_ctrl_c_drains_the_pools_and_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    p = _cli(run_dir, "--checkpoint-every", "100")
    assert _when(lambda: len(_journal(run_dir)) >= 1 or p.poll() is not None), "no progress"
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    assert "stopping" in out and "continue with: thinkcraft train llm-policy --resume" in out
    st = _ckpt(run_dir)
    assert 1 <= st["step"] < 5 and st["step"] == len(_journal(run_dir))  # the update in flight finished first
    p2 = _cli(run_dir, "--resume")
    out, _ = p2.communicate(timeout=600)
    assert p2.returncode == 0, out[-3000:]
    _trained_once(run_dir)
