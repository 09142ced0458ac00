"""The impure shell every training command shares: run directory, resume, metrics, checkpoints, Ctrl-C,
progress, and the final curve. Loops (ppo, ppo_hidden) keep only their own phases.

    with TrainSession(cfg, "ppo", shape_fields=..., defaults=PPOConfig(), total_steps=...) as s:
        state = s.restore(template) if s.resuming else init()
        while s.running(update):
            ... one chunk ...
            s.log(update, env_steps, metrics, sps=...)
            s.maybe_checkpoint(update, env_steps, state, params)
    summary = s.summary
"""

from __future__ import annotations

import dataclasses
import signal
import time
from pathlib import Path
from typing import Any, Sequence

from thinkcraft.train.checkpoint import (
    check_resume_compatible, latest_meta, load_checkpoint, load_config_dict, prepare_run_dir, save_checkpoint,
    save_config,
)
from thinkcraft.utils.errors import UserError
from thinkcraft.utils.metrics import MetricsWriter, truncate_metrics
from thinkcraft.utils.plot import plot_curves
from thinkcraft.utils.progress import RunProgress, console
from thinkcraft.utils.timing import PhaseTimer


class TrainSession:
    def __init__(
        self,
        cfg: Any,
        command: str,
        *,
        shape_fields: Sequence[str],
        defaults: Any,
        total_steps: int,
        derived: dict[str, Any] | None = None,
        plot_keys: Sequence[str] = ("episode/return", "achievements/mean_rate", "episode/length", "sps"),
        title: str = "",
    ) -> None:
        # 1. run directory and config (before anything compiles)
        if cfg.resume:
            run_dir = Path(cfg.resume)
            saved = load_config_dict(run_dir)
            cfg = check_resume_compatible(saved, cfg, tuple(shape_fields), defaults)
            cfg = dataclasses.replace(cfg, resume=str(run_dir), run_name=run_dir.name)
            self.resume_meta = latest_meta(run_dir)
            if self.resume_meta is None:
                raise UserError(f"{run_dir} has no checkpoint yet; start it again with --overwrite")
            self.saved_derived = saved.get("_derived", {})
        else:
            name = cfg.run_name or f"{command}-{cfg.env_name}-s{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
            run_dir = prepare_run_dir(cfg.runs_dir, name, cfg.overwrite)
            self.resume_meta = None
            self.saved_derived = {}
        self.cfg = cfg
        self.run_dir = run_dir
        self.command = command
        self.total_steps = total_steps
        self.derived = dict(derived or {})
        self.plot_keys = plot_keys
        self.title = title or f"{command} {cfg.env_name}"
        self.timer = PhaseTimer()
        self.summary: dict[str, Any] = {"run_dir": str(run_dir)}
        self.stop_requested = False
        self._last_ckpt_time = time.time()
        self._last_ckpt_update: int | None = None
        self._writer: MetricsWriter | None = None
        self._progress: RunProgress | None = None
        self._prev_handler: Any = None

    @property
    def resuming(self) -> bool:
        return self.resume_meta is not None

    def save_config(self, **more_derived: Any) -> None:
        self.derived.update(more_derived)
        save_config(self.run_dir, self.cfg, self.derived)

    def restore(self, template: Any) -> Any:
        """The last checkpoint's state (shaped like `template`), metrics truncated to match."""
        import jax

        state, meta = load_checkpoint(self.run_dir, template)
        self.resume_meta = meta
        truncate_metrics(self.run_dir / "metrics.jsonl", int(meta["env_steps"]))
        console.print(f"resuming {self.run_dir} at update {meta['update']} ({meta['env_steps']:,} steps)")
        return jax.device_put(state)

    # --- loop helpers -------------------------------------------------------------------------------
    def __enter__(self) -> "TrainSession":
        cfg = self.cfg
        self._writer = MetricsWriter(self.run_dir, tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project,
                                     config=dataclasses.asdict(cfg))
        self._prev_handler = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._on_sigint)
        self._progress = RunProgress(self.total_steps, self.title).__enter__()
        return self

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.stop_requested:
            signal.signal(signal.SIGINT, self._prev_handler)
            raise KeyboardInterrupt
        self.stop_requested = True
        console.print("\n[yellow]Ctrl-C: stopping after this chunk and saving a checkpoint "
                      "(press again to abort now; the previous checkpoint stays valid)[/yellow]")

    def start(self, update: int) -> None:
        self._last_ckpt_update = update
        self._start_update = update

    def running(self, update: int, end_update: int) -> bool:
        return update < end_update and not self.stop_requested

    def log(self, update: int, env_steps: int, metrics: dict[str, Any], **progress_fields: Any) -> dict[str, Any]:
        rec = {k: v for k, v in metrics.items() if v is not None}
        rec["update"] = update
        assert self._writer is not None and self._progress is not None
        self._writer.write(env_steps, rec)
        self._progress.update(env_steps, **progress_fields)
        self.summary.update(rec)
        return rec

    def maybe_checkpoint(self, update: int, env_steps: int, state: Any, params: Any, force: bool = False) -> bool:
        cfg = self.cfg
        due_u = cfg.checkpoint_every_updates and update - (self._last_ckpt_update or 0) >= cfg.checkpoint_every_updates
        due_t = cfg.checkpoint_every_minutes and time.time() - self._last_ckpt_time >= 60 * cfg.checkpoint_every_minutes
        if not (force or due_u or due_t) or update == self._last_ckpt_update:
            return False
        with self.timer.phase("checkpoint"):
            save_checkpoint(self.run_dir, state, params, {"update": update, "env_steps": env_steps})
        self._last_ckpt_time, self._last_ckpt_update = time.time(), update
        return True

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(exc_type, exc, tb)
        signal.signal(signal.SIGINT, self._prev_handler)
        if self._writer is not None:
            self._writer.close()
        if exc_type is None and self.cfg.plot:
            plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curve.png", self.plot_keys, title=self.title)
        self.summary["interrupted"] = self.stop_requested
