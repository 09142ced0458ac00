"""`thinkcraft plan`: synthetic runs built from a known cost per sample and pool (device-seconds), written as
llm-policy / ppo-hidden / ppo would log them; the plan must recover the costs, name the bottleneck, size the
pools for a target, and split a cluster so that the rate it predicts is what the cost model gives."""

from __future__ import annotations

import json
import math

import pytest

from thinkcraft.analysis.plan import PoolCost, best_split, measure, place, plan
from thinkcraft.cli import main
from thinkcraft.utils.errors import UserError

WARMUP = {"timing/generate": 99.0, "timing/train": 50.0, "timing/env": 9.0, "timing/llm": 40.0,
          "timing/env_policy": 30.0}


def llm_policy_records(cost: dict[str, float], samples: int, steps: int = 4, busy_sum: bool = False,
                       devices: int = 1) -> list[dict]:
    """A sync llm-policy run: phases back to back, each `samples × cost` seconds of its devices (wall: / devices);
    `busy_sum`: async, timing/generate the engines' summed busy seconds, the step as long as the busiest pool."""
    gen = samples * cost["rollout"] / (1 if busy_sum else devices)
    env, train = samples * cost["env"], samples * cost["learner"]
    step = max(samples * cost["rollout"] / devices, train) if busy_sum else gen + env + train
    rec = {"timing/generate": gen, "timing/env": env, "timing/train": train, "timing/step": step,
           "perf/samples_per_s": samples / step, "reward/mean": 0.5}
    return [{**rec, **{k: v for k, v in WARMUP.items() if k in rec}}] + [dict(rec) for _ in range(steps)]


def write_run(tmp_path, config: dict, records: list[dict]) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(tmp_path)


def test_llm_policy_sync_costs_bottleneck_and_pool_sizes():
    cost = {"rollout": 0.3, "env": 0.06, "learner": 0.1}
    m = measure({"mode": "sync", "reward": "rule"}, llm_policy_records(cost, samples=16))
    got = {p.name: p.device_s_per_sample for p in m.pools}
    assert got == pytest.approx({"rollout": 0.3, "env+reward (CPU)": 0.06, "learner": 0.1})
    assert m.records_used == 4 and m.rate == pytest.approx(16 / (16 * 0.46))  # the warm-up record is dropped
    assert m.bottleneck == "rollout"
    p = plan(m, target=20, nodes=1, gpus_per_node=16, utilization=1.0)
    assert p.fits is False  # 8 GPUs would do, but the learner cannot take 2
    assert p.gpus == {"rollout": 6, "learner": 2} and p.cpu_cores == pytest.approx({"env+reward (CPU)": 1.2})
    assert any("learner needs 2 GPUs but runs on 1" in n for n in p.notes)  # no data-parallel learner
    assert any("env+reward (CPU) needs 1.2 CPU cores" in n for n in p.notes)
    assert m.serial and any("--mode async" in n for n in p.notes)  # its pools shared one device


def test_llm_policy_async_with_a_judge_and_a_cluster():
    cost = {"rollout": 0.4, "env": 0.02, "learner": 0.05}
    recs = llm_policy_records(cost, samples=64, busy_sum=True, devices=3)
    for r in recs:
        r["timing/reward"] = 64 * 0.1  # the judge pool's device-seconds
    cfg = {"mode": "async", "reward": "judge", "rollout_devices": "cuda:1,cuda:2,cuda:3", "rollout_servers": ""}
    m = measure(cfg, recs)
    got = {p.name: (p.device_s_per_sample, p.measured_devices, p.on_gpu) for p in m.pools}
    assert got == {"rollout": pytest.approx((0.4, 3, True)), "reward": pytest.approx((0.1, 1, True)),
                   "learner": pytest.approx((0.05, 1, True))}
    # 3 engines at 0.4 s per sample: 7.5 samples/s, the learner 20 /s: the engines are the bottleneck
    assert m.rate == pytest.approx(7.5) and m.bottleneck == "rollout"
    p = plan(m, target=30, nodes=2, gpus_per_node=8, utilization=1.0)
    assert p.gpus == {"rollout": 12, "reward": 3, "learner": 2} and not p.fits
    # best split of 16: the learner stays at 1 (20 samples/s), so the rate stops there; the rest max-min
    # (trimmed to what 20 /s needs: 8 engines, 2 judges; the other 5 GPUs stay idle)
    assert p.best_split == {"rollout": 8, "reward": 2, "learner": 1} and p.best_rate == pytest.approx(20.0)
    assert p.placement[0][:3] == ["learner", "reward", "reward"] and sum(map(len, p.placement)) == 11
    assert not m.serial and any("Ray" in n for n in p.notes) and not any("--mode async" in n for n in p.notes)


def test_ppo_hidden_costs_from_sharded_envs_and_feature_devices():
    batch, wall = 12800, 1.28
    rec = {"sps": batch / wall, "timing/update_wall": wall, "timing/env_policy": 0.5, "timing/update": 0.2,
           "timing/llm": 1.0, "timing/render": 0.1, "llm/share": 1.0 / wall}
    cfg = {"feature_devices": ["cuda:2", "cuda:3"], "_derived": {"env_shards": 2, "batch_size": batch}}
    m = measure(cfg, [{**rec, "timing/llm": 40.0}, rec, rec])
    got = {p.name: p.device_s_per_sample * batch for p in m.pools}
    assert got == pytest.approx({"env": 1.4, "features": 2.0, "render (CPU)": 0.1})
    assert m.bottleneck == "features"  # 2 engines busy 1.0 s of 1.28; the envs 0.7 s
    p = plan(m, target=30_000, nodes=1, gpus_per_node=8, utilization=1.0)
    assert p.gpus == {"env": math.ceil(30_000 * 1.4 / batch), "features": math.ceil(30_000 * 2.0 / batch)} == \
        {"env": 4, "features": 5}
    assert p.fits is False
    # 8 GPUs, max-min by hand: env 3 (27,429 /s), features 5 (32,000 /s)
    assert p.best_split == {"env": 3, "features": 5} and p.best_rate == pytest.approx(3 * batch / 1.4)


def test_plain_ppo_and_small_helpers():
    m = measure({}, [{"sps": 5e5}, {"sps": 1e6}, {"sps": 1e6}])
    assert m.job == "ppo" and m.rate == 1e6 and m.pools[0].device_s_per_sample == pytest.approx(1e-6)
    assert plan(m, target=3.6e6, utilization=1.0).gpus == {"env": 4}
    pools = [PoolCost("a", 1.0, 1, True), PoolCost("b", 2.0, 1, True)]
    assert best_split(pools, 6, 1.0) == ({"a": 2, "b": 4}, 2.0)
    assert best_split(pools, 1, 1.0) == ({"a": 0, "b": 0}, pytest.approx(1 / 3))  # one GPU shared
    assert place({"rollout": 3, "learner": 1}, 2, 2) == [["learner", "rollout"], ["rollout", "rollout"]]


def test_plan_cli_prints_the_plan_and_rejects_what_it_cannot_read(tmp_path, capsys):
    run = write_run(tmp_path / "run", {"mode": "sync"}, llm_policy_records({"rollout": 0.3, "env": 0.05,
                                                                            "learner": 0.1}, samples=16))
    assert main(["plan", run, "--target-samples-per-s", "20", "--nodes", "1", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "bottleneck: rollout" in out and "node 0: learner" in out
    assert main(["plan", run]) == 2
    assert "--target-samples-per-s: give the throughput" in capsys.readouterr().err
    assert main(["plan", run, "--target-samples-per-s", "5", "--nodes", "2"]) == 2
    assert main(["plan", str(tmp_path / "none"), "--target-samples-per-s", "5"]) == 2
    assert "not a thinkcraft run directory" in capsys.readouterr().err
    (tmp_path / "nometrics").mkdir()
    (tmp_path / "nometrics/config.json").write_text("{}")
    assert main(["plan", str(tmp_path / "nometrics"), "--target-samples-per-s", "5"]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(UserError, match="the ppo-hidden metrics lack timing/update_wall"):
        measure({}, [{"sps": 1.0, "timing/llm": 1.0, "timing/env_policy": 1, "timing/update": 1}])
    with pytest.raises(UserError, match="not from train llm-policy, ppo-hidden or ppo"):
        measure({}, [{"losses/total": 1.0}])
    with pytest.raises(UserError, match="no metrics records"):
        measure({}, [])
