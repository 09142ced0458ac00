"""The impure shell of the asynchronous loop: run directory, resume, the pieces built in order, per-update
metrics, the trajectory store, the consumed-ids journal and checkpoints. The loop itself is async_loop.py.

Files in the run directory (beside the synchronous loop's metrics.jsonl, checkpoint.pt, trajectories/,
curve.png): `consumed.jsonl`, one line per update {"step": version, "groups", "traj_ids", "staleness"}, the
trajectories each update trained on (truncated to the checkpoint on resume), and `weights/` for HTTP engines.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from thinkcraft.pools import Failure, SharedWeights
from thinkcraft.train.llm_policy.async_build import (
    TrainResult, TrainWorker, build_front, build_reward_pool, build_rollout_pool, build_slots, device_name,
    env_spec, seed_everything, weight_update,
)
from thinkcraft.train.llm_policy.async_loop import Coordinator, ResumeState, group_seed_fn
from thinkcraft.utils.errors import ConfigError, UserError

PLOT_KEYS = ["reward/mean", "reward/correct_rate", "staleness/mean", "engine/idle_share", "perf/samples_per_s"]


class AsyncRun:
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_path = self.run_dir / "checkpoint.pt"
        if not cfg.resume and self.ckpt_path.exists():
            raise UserError(f"{self.run_dir} already holds a run; pass --resume to continue it or choose another "
                            "--run-dir")
        self.summary: dict[str, Any] = {}
        self.progress: Any = None
        self._closers: list[Any] = []
        self._last_ckpt = -1

    # ------------------------------------------------------------------------------------------- build

    def build(self) -> "AsyncRun":
        import torch

        from thinkcraft.llm.protocol import SamplingParams
        from thinkcraft.train.llm_policy.learner import Learner, load_checkpoint
        from thinkcraft.train.llm_policy.model import _device, check_engine_for_algo, load_policy, make_engine
        from thinkcraft.train.llm_policy.rollout import _prompt_corpus
        from thinkcraft.utils.io import atomic_write_json
        from thinkcraft.utils.metrics import MetricsWriter, truncate_metrics

        cfg = self.cfg
        # 1. policy, in the synchronous loop's order (the same random draws before the first sample)
        device = _device(cfg.device)
        autocast = torch.bfloat16 if (device.type == "cuda" and cfg.bf16) else None
        base_dtype = torch.bfloat16 if (autocast is not None and cfg.finetune == "lora") else torch.float32
        seed_everything(cfg.seed)
        env = env_spec(cfg, latency=False).build()
        corpus = _prompt_corpus(cfg, env) if cfg.model_spec.scheme == "random" else []
        model, tok = load_policy(cfg, corpus, device, base_dtype)
        if cfg.thinking_budget is not None and not {"<think>", "</think>"} <= set(tok.get_vocab()):
            raise ConfigError("thinking_budget", f"{cfg.model} has no <think>/</think> tokens; drop --thinking-budget")
        own_engine = make_engine(model, tok, cfg)
        check_engine_for_algo(own_engine.capabilities, cfg.algo)
        self.learner = learner = Learner(cfg, model, tok, device, autocast)
        self.tokenizer = tok
        self.sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                       top_p=cfg.top_p, logprobs=True, thinking_budget=cfg.thinking_budget)
        # 2. resume: weights, optimizer, RNG; the group ids consumed; journals truncated to the checkpoint
        version, extra = 0, {}
        if cfg.resume and self.ckpt_path.exists():
            version, extra = load_checkpoint(self.ckpt_path, learner)
            truncate_metrics(self.run_dir / "metrics.jsonl", version)
            truncate_metrics(self.run_dir / "consumed.jsonl", version)
            self._last_ckpt = version
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.run_dir / "config.json", asdict(cfg))
        self.writer = self._store(version)
        self.metrics = MetricsWriter(self.run_dir)
        self._closers.append(self.metrics.close)
        self.journal = open(self.run_dir / "consumed.jsonl", "a", encoding="utf-8")
        self._closers.append(self.journal.close)
        model_dir = None if cfg.model_spec.scheme == "random" else str(_model_dir(cfg.model))
        # 3. judge, A*-PO's V* (before the pools: it samples with the engine alone)
        self.model_lock = threading.Lock()
        self.judge = _judge(cfg, learner, tok) if cfg.reward == "judge" else None
        v_star = extra.get("v_star")
        if cfg.algo == "apo" and v_star is None:
            v_star = _apo_offline(cfg, env, own_engine, tok, learner, self.sampling)
        # 4. engines and pools
        self.slots = build_slots(cfg, learner, tok, own_engine, self.model_lock, self.run_dir, model_dir, version)
        self.rollout = build_rollout_pool(cfg, tok, self.sampling)
        self.front = build_front(cfg, self.slots, self.rollout)
        self.rollout.attach(self.front)
        if not all(isinstance(s.sync, SharedWeights) for s in self.slots):
            self.front.publish(weight_update(learner, version, self.slots))  # HTTP engines start at this run's weights
        self.reward = build_reward_pool(cfg, self.judge, self.model_lock if cfg.judge_engine == "self" else None)
        self.worker = TrainWorker(cfg, learner, tok, self.front, self.slots, self.model_lock, version,
                                  extra.get("baseline"), v_star)
        self.train_pool = self.worker.pool()
        resume = ResumeState.from_checkpoint(extra, version, cfg.prompts_per_step)
        self.coord = Coordinator(cfg, version, resume, group_seed_fn(cfg, v_star), self.rollout, self.reward,
                                 self.train_pool)
        self.learner_device = device_name(device)
        self._t_last = time.perf_counter()
        self._prev = self._busy_snapshot()
        return self

    def _store(self, version: int) -> Any:
        if not self.cfg.store:
            return None
        import re

        from thinkcraft.data.writer import TrajectoryWriter

        run = re.sub(r"[^A-Za-z0-9._-]", "-", self.run_dir.name) or "run"
        _drop_partitions_from(self.run_dir / "trajectories", run, version)
        w = TrajectoryWriter(self.run_dir / "trajectories", run=run, max_per_file=1024, max_seconds=30.0)
        self._closers.append(w.close)
        return w

    # ------------------------------------------------------------------------------------ per update

    def on_trained(self, res: TrainResult | Failure) -> None:
        from thinkcraft.train.llm_policy.rollout import episode_record

        if isinstance(res, Failure):
            raise UserError(f"the learner failed ({res.reason}: {res.detail}); the last checkpoint is intact")
        self.coord.trained(res)
        if self.writer is not None:
            for e, tid, stale in zip(res.episodes, res.traj_ids, res.staleness):
                rec = episode_record(e, self.cfg.env, min(t.policy_version for t in e.turns),
                                     {"algo": self.cfg.algo, "traj_id": tid, "staleness": stale})
                self.writer.add(rec, learner_step=res.version - 1)
        self.journal.write(json.dumps({"step": res.version, "groups": res.groups, "traj_ids": res.traj_ids,
                                       "staleness": res.staleness}) + "\n")
        self.journal.flush()
        rec = self._metrics(res)
        self.summary = self.metrics.write(res.version, rec)
        if self.progress is not None:
            self.progress.update(res.version, reward=rec["reward/mean"], stale=rec["staleness/mean"],
                                 queue=rec["queue/rollout_queued"] + rec["queue/rollout_running"],
                                 buffer=rec["queue/buffer_groups"], idle=rec["engine/idle_share"],
                                 samples_s=rec["perf/samples_per_s"])
        self.checkpoint(force=False)

    def _busy_snapshot(self) -> dict[str, Any]:
        st = self.front.stats()
        pools = {"rollout": self.rollout.health(), "train": self.train_pool.health()}
        if self.reward is not None:
            pools["reward"] = self.reward.health()
        return {"t": time.perf_counter(), "engine": st, "pools": pools, "learner_busy_s": self.worker.busy_s}

    def _metrics(self, res: TrainResult) -> dict[str, Any]:
        cfg, coord = self.cfg, self.coord
        now = self._busy_snapshot()
        prev, self._prev = self._prev, now
        dt = max(now["t"] - prev["t"], 1e-9)
        eps = res.episodes
        turns = [t for e in eps for t in e.turns]
        n_gen = sum(len(t.completion_ids) for t in turns)
        rewards = [sum(t.reward for t in e.turns) for e in eps]
        rec: dict[str, Any] = {
            "reward/mean": float(np.mean(rewards)), "reward/std": float(np.std(rewards)),
            "reward/turn_mean": float(np.mean([t.reward for t in turns])),
            "format/invalid_rate": float(np.mean([t.invalid for t in turns])),
            "completion/mean_tokens": n_gen / max(len(turns), 1),
            "completion/truncated_rate": float(np.mean([t.finish_reason == "length" for t in turns])),
            "episode/turns": len(turns) / max(len(eps), 1),
            "perf/samples_per_s": len(eps) / dt, "perf/decisions_per_s": len(turns) / dt,
            "perf/tokens_per_s": n_gen / dt, "timing/step": dt, "timing/train": res.train_s,
            "policy_version": res.version, **res.stats,
        }
        if cfg.env in ("arith", "gsm8k"):
            rec["reward/correct_rate"] = float(np.mean([t.info.get("correct", False) for t in turns]))
        stale = np.asarray(res.staleness)
        rec["staleness/mean"], rec["staleness/max"] = float(stale.mean()), int(stale.max())
        for k in range(cfg.max_staleness + 1):
            rec[f"staleness/hist_{k}"] = int((stale == k).sum())
        rec.update(_pool_metrics(prev, now, dt, coord, self.slots, self.learner_device))
        if self.judge is not None:
            rec.update({k: v for k, v in self.judge.counters().items() if k.startswith("judge/")})
        return rec

    # --------------------------------------------------------------------------------- checkpoint/stop

    def checkpoint(self, force: bool) -> None:
        from thinkcraft.train.llm_policy.learner import save_checkpoint

        v, every = self.coord.version, self.cfg.checkpoint_every
        due = force or (every and v % every == 0) or v == self.cfg.steps
        if not due or v == self._last_ckpt or self.coord.training is not None:
            return
        if self.writer is not None:
            self.writer.flush()  # the store holds every trained episode before the checkpoint commits
        save_checkpoint(self.ckpt_path, self.learner, v, {
            "baseline": self.worker.baseline, "v_star": self.worker.v_star, "config": asdict(self.cfg),
            "async": self.coord.state()})
        self._last_ckpt = v

    def stop_pools(self) -> None:
        self.rollout.stop(drain=False, timeout_s=10.0)
        if self.reward is not None:
            self.reward.stop(drain=False, timeout_s=10.0)
        self.front.stop(timeout_s=10.0)
        self.train_pool.stop(drain=True, timeout_s=60.0)
        self.coord.collect(0.0)  # count what was abandoned (played again on resume)

    def close(self) -> None:
        for c in reversed(self._closers):
            c()
        self._closers.clear()
        if self.cfg.plot and (self.run_dir / "metrics.jsonl").exists():
            from thinkcraft.utils.plot import plot_curves

            plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curve.png", PLOT_KEYS,
                        title=f"llm-policy {self.cfg.algo} on {self.cfg.env} (async, η={self.cfg.max_staleness})")


def build_run(cfg: Any) -> AsyncRun:
    run = AsyncRun(cfg)
    try:
        return run.build()
    except BaseException:
        run.close()
        raise


def _pool_metrics(prev: dict[str, Any], now: dict[str, Any], dt: float, coord: Any, slots: list[Any],
                  learner_device: Any) -> dict[str, Any]:
    """Queue depths now; busy shares over the interval since the previous update; failures so far."""
    out: dict[str, Any] = {}
    ro = now["pools"]["rollout"]
    out["queue/rollout_queued"], out["queue/rollout_running"] = ro.queued, ro.running
    out["queue/buffer_groups"] = len(coord.buffer)
    if "reward" in now["pools"]:
        out["queue/reward"] = now["pools"]["reward"].queued + now["pools"]["reward"].running
    for name, h in now["pools"].items():
        out[f"pool/{name}_busy"] = (h.busy_s - prev["pools"][name].busy_s) / max(h.workers * dt, 1e-9)
    e0, e1 = prev["engine"], now["engine"]
    busy = [b1 - b0 for b0, b1 in zip(e0.busy_s, e1.busy_s)]
    out["engine/idle_share"] = 1.0 - sum(busy) / max(len(busy) * dt, 1e-9)
    out["engine/batches"] = e1.batches
    out["engine/mean_batch_rows"] = (e1.rows - e0.rows) / max(e1.batches - e0.batches, 1)
    out["engine/min_version"] = min(e1.versions)
    out["weights/update_failures"] = e1.update_failures
    # device idle share: each device's engines plus the learner on its device, over the interval
    learner_busy = now["learner_busy_s"] - prev["learner_busy_s"]
    per_device: dict[str, float] = {}
    for s, b in zip(slots, busy):
        if s.device is not None:  # remote engines' devices are not ours to count
            per_device[s.device] = per_device.get(s.device, 0.0) + b
    per_device[learner_device] = per_device.get(learner_device, 0.0) + learner_busy
    out["gpu/idle_share"] = float(np.mean([1.0 - min(1.0, b / dt) for b in per_device.values()]))
    failed = {k: v for k, v in coord.counts.items()}
    out["rollout/failed"] = sum(v for k, v in failed.items() if k.startswith("rollout/failed/"))
    out.update(failed)
    out["rollout/restarts"] = ro.restarts
    return out


def _drop_partitions_from(root: Path, run: str, learner_step: int) -> None:
    """Resume: the store's partitions of updates after the checkpoint go (they are trained again).
    (The training shell's data.writer.drop_partitions_from replaces this when it lands on main.)"""
    import shutil

    for d in (root / f"run={run}").glob("step=*"):
        if d.is_dir() and d.name[5:].isdigit() and int(d.name[5:]) >= learner_step:
            shutil.rmtree(d)


def _model_dir(spec: str) -> Path:
    from thinkcraft.train.llm_policy.model import resolve_model_path

    return resolve_model_path(spec)


def _judge(cfg: Any, learner: Any, tok: Any) -> Any:
    """The judge RewardFn: the policy with its adapter off ('self', a separate engine over the learner's
    model, called under the learner's lock), or any engine spec."""
    from thinkcraft.envs.textenvs import JudgeReward
    from thinkcraft.train.llm_policy.model import _AdapterOffEngine, make_engine

    msgs = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    if cfg.judge_engine == "self":
        engine = _AdapterOffEngine(make_engine(learner.model, tok, cfg), learner.model)
        fmt = lambda text: tok.apply_chat_template(msgs(text), add_generation_prompt=True, tokenize=False)  # noqa: E731
    else:
        from thinkcraft.llm import make_engine as make_engine_from_spec

        engine = make_engine_from_spec(cfg.judge_engine, **cfg.judge_engine_options())
        fmt = (lambda text: engine.apply_chat_template(msgs(text))) if engine.capabilities.tokenizer else None
    return JudgeReward(engine, answer_weight=cfg.answer_weight, format_weight=cfg.format_weight, format_prompt=fmt)


def _apo_offline(cfg: Any, env: Any, engine: Any, tok: Any, learner: Any, sampling: Any) -> dict[int, float]:
    """A*-PO's V*(x) from reference samples of each prompt in the pool (π_ref = the initial policy), with the
    engine alone before the pools start."""
    import torch

    from thinkcraft.rl.llm_losses import apo_value
    from thinkcraft.train.llm_policy.rollout import _seed_of, rollout

    pool = [_seed_of(cfg, 0, i) for i in range(cfg.apo_pool_size)]
    eps = rollout(env, engine, tok, pool, cfg.apo_ref_samples, sampling, cfg.history_turns,
                  gen_context=learner.autocast)
    r = torch.tensor([e.total_reward for e in eps], dtype=torch.float64).view(len(pool), cfg.apo_ref_samples)
    return {int(s): float(x) for s, x in zip(pool, apo_value(r, cfg.apo_beta1))}
