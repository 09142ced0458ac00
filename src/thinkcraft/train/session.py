"""The impure shell every training command shares (`train ppo`, `train ppo-hidden`, `train llm-policy`):
run directory, resume, metrics, verified checkpoints, Ctrl-C/SIGTERM, progress and the final curve.
Loops keep only their own phases.

    session = TrainSession(cfg, "ppo", shape_fields=..., defaults=PPOConfig(),
                           total_steps=lambda c: c.num_updates * c.batch_size, title=lambda c: f"PPO {c.env_name}")
    cfg = session.cfg                       # on --resume: the saved config merged with the command line
    with session:                           # Ctrl-C / SIGTERM now request a stop instead of killing
        state = session.restore(template) if session.resuming else init()
        session.start(update)               # metrics file and progress open here
        while session.running(update, end_update):
            ... one chunk ...
            session.log(update, env_steps, metrics, sps=...)
            session.maybe_checkpoint(update, env_steps, state, params)
        session.maybe_checkpoint(update, env_steps, state, params, force=True)
    summary = session.summary

Order of events on `--resume`: the saved config is read and merged, and the newest checkpoint verified
(sha256 of every file), in the constructor, before anything in the run directory is written; `restore`
then decodes it and truncates the metrics to the checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from thinkcraft.train.checkpoint import (
    JAX_CODEC, Checkpoint, CheckpointError, Codec, adopt, check_resume_compatible, commit_checkpoint,
    has_checkpoint, load_config_dict, prepare_run_dir, read_checkpoint, save_config,
)
from thinkcraft.utils.errors import UserError, check
from thinkcraft.utils.hardware import gpu_name
from thinkcraft.utils.metrics import MetricsWriter, truncate_metrics, unpack_metrics
from thinkcraft.utils.plot import plot_curves
from thinkcraft.utils.progress import RunProgress, console
from thinkcraft.utils.signals import StopRequest
from thinkcraft.utils.timing import PhaseTimer


def hardware_name() -> str:
    """The accelerator this process computes on (`utils.hardware.gpu_name`), else "cpu"."""
    return gpu_name() or "cpu"


@dataclass
class RunOptions:
    """Where a training run lives, how it resumes, checkpoints and logs (shared by every `train` command)."""

    run_dir: str | None = None
    """The run directory (config, metrics, checkpoints, curve). Default: <runs-dir>/<run-name>."""
    run_name: str | None = None
    """Run directory name under --runs-dir (default: <command>-<env>-s<seed>-<date>-<time>)."""
    runs_dir: str = "runs"
    """Where named run directories go."""
    resume: bool = False
    """Continue the run in --run-dir (or --run-name) from its newest checkpoint; fields not given on the
    command line take the saved values. Without it an existing non-empty run directory is refused."""
    resume_fallback: bool = False
    """With --resume: when the newest checkpoint fails verification, resume from the newest older one that
    verifies (the bad ones are renamed checkpoint/corrupt-*)."""
    overwrite: bool = False
    """Delete an existing run directory and start again in it."""
    checkpoint_every: int = 0
    """Checkpoint every N updates (llm-policy: learner steps); 0 = by time and at the end only."""
    checkpoint_every_minutes: float = 10.0
    """Checkpoint at the first chunk end after this many minutes (0 = off)."""
    keep_checkpoints: int = 2
    """Checkpoints kept in the run directory (the newest K); older ones are deleted after a new one is committed."""
    tensorboard: bool = False
    """Also log to TensorBoard (<run-dir>/tb)."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project."""
    plot: bool = True
    """Write <run-dir>/curve.png at the end."""
    log_every_s: float = 10.0
    """Progress line interval when the output is not a terminal."""

    def __post_init__(self) -> None:
        check(not (self.run_dir and self.run_name), "run_name", "give --run-dir or --run-name, not both")
        check(not (self.resume and self.overwrite), "overwrite",
              "--resume continues a run and --overwrite replaces it: pick one")
        check(not self.resume or bool(self.run_dir or self.run_name), "resume",
              "say which run: --resume --run-dir DIR (or --run-name NAME)")
        check(not self.resume_fallback or self.resume, "resume_fallback", "applies with --resume")
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0")
        check(self.checkpoint_every_minutes >= 0, "checkpoint_every_minutes", "must be >= 0")
        check(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
        check(self.log_every_s > 0, "log_every_s", "must be > 0")
        if not self.resume:
            self.validate()

    def validate(self) -> None:
        """The command's own checks (each config overrides it). With --resume they run in TrainSession once
        the command line is merged with the saved config: until then a field left out is at its default, not
        at the run's value, and a check across fields could fail for nothing."""

    def run_label(self) -> str:
        """The middle of the default run name (`<env>-s<seed>`); each command's config says it."""
        raise NotImplementedError


# where the run lives and how this invocation treats it: the command line's alone, never merged from the saved run
RUN_LOCATION_FIELDS = ("run_dir", "run_name", "runs_dir", "resume", "resume_fallback", "overwrite")


def resume_command(command: str, run_dir: Path | str) -> str:
    return f"thinkcraft train {command} --resume --run-dir {run_dir}"


class TrainSession:
    def __init__(
        self,
        cfg: Any,
        command: str,
        *,
        shape_fields: Sequence[str],
        defaults: Any,
        total_steps: Callable[[Any], int],
        title: Callable[[Any], str],
        plot_keys: Sequence[str] = ("episode/return", "achievements/mean_rate", "episode/length", "sps"),
        codec: Codec = JAX_CODEC,
        x_label: str = "environment steps",
        update_word: str = "update",
    ) -> None:
        # 1. the run directory; on --resume the saved config and the verified checkpoint (nothing written yet)
        if cfg.run_dir:
            run_dir = Path(cfg.run_dir)
        else:
            name = cfg.run_name or f"{command}-{cfg.run_label()}-{time.strftime('%Y%m%d-%H%M%S')}"
            run_dir = Path(cfg.runs_dir) / name
        self.checkpoint: Checkpoint | None = None
        self._fallback_problems: list[str] = []
        self.saved_derived: dict[str, Any] = {}
        if cfg.resume:
            saved = load_config_dict(run_dir)
            self.saved_derived = saved.get("_derived", {})
            saved_command = self.saved_derived.get("command", command)
            if saved_command != command:
                raise UserError(f"{run_dir} is a `train {saved_command}` run; continue it with "
                                f"{resume_command(saved_command, run_dir)}")
            cfg = check_resume_compatible(saved, cfg, shape_fields, defaults, skip=RUN_LOCATION_FIELDS)
            cfg.validate()
            if not has_checkpoint(run_dir):
                raise UserError(f"{run_dir} has no checkpoint yet (stopped before its first one); start it again "
                                "with --overwrite")
            self.checkpoint, self._fallback_problems = read_checkpoint(run_dir, fallback=cfg.resume_fallback)
            for p in self._fallback_problems:
                console.print(f"[yellow]{p}: skipped[/yellow]", soft_wrap=True)
            cp = self.checkpoint
            steps = f" ({cp.env_steps:,} steps)" if cp.env_steps != cp.update else ""
            console.print(f"resuming {run_dir} from {update_word} {cp.update:,}{steps}", soft_wrap=True)
        else:
            prepare_run_dir(run_dir, cfg.overwrite)
        self.cfg = cfg = dataclasses.replace(cfg, run_dir=str(run_dir), run_name=None)
        self.run_dir = run_dir
        self.command = command
        self.codec = codec
        self.total_steps = total_steps(cfg)
        self.title = title(cfg)
        self.plot_keys = plot_keys
        self.x_label = x_label
        self.update_word = update_word
        self.resume_command = resume_command(command, run_dir)
        # where the run computed, every card of a run resumed elsewhere, in order: results collected later on
        # another machine (bench/ppo_parity.py, bench/llm_features.py) read the card from here
        hardware = list(self.saved_derived.get("hardware", []))
        if hardware_name() not in hardware:
            hardware.append(hardware_name())
        self.derived: dict[str, Any] = {"command": command, "hardware": hardware}
        self.timer = PhaseTimer()
        self.summary: dict[str, Any] = {"run_dir": str(run_dir)}
        self._stop = StopRequest("stopping after the chunk in flight and saving a checkpoint "
                                 "(an abort keeps the previous one)")
        self._last_ckpt_time = time.time()
        self._last_ckpt_update: int | None = self.checkpoint.update if self.checkpoint else None
        self._ckpt_base = self._last_ckpt_update or 0
        self._writer: MetricsWriter | None = None
        self._progress: RunProgress | None = None

    @property
    def resuming(self) -> bool:
        return self.checkpoint is not None

    @property
    def stop_requested(self) -> bool:
        return self._stop.requested

    def save_config(self, **more_derived: Any) -> None:
        """config.json: the run's config (without this invocation's --resume/--overwrite) and derived values."""
        self.derived.update(more_derived)
        save_config(self.run_dir, dataclasses.replace(self.cfg, resume=False, resume_fallback=False, overwrite=False),
                    self.derived)

    def restore(self, template: Any = None) -> Any:
        """The verified checkpoint's state (decoded with `template`); metrics truncated to match. After a
        --resume-fallback the newer, bad checkpoints are set aside here, once the chosen one has decoded."""
        cp = self.checkpoint
        assert cp is not None, "restore() is for resumed runs (session.resuming)"
        try:
            state = self.codec.decode(cp.files, template)
        except Exception as e:  # verified bytes that do not fit: another version or another model
            raise CheckpointError(f"{cp.dir / self.codec.state_file} does not fit this run's state "
                                  f"({type(e).__name__}: {str(e)[:200]})") from None
        if self._fallback_problems:
            for moved in adopt(self.run_dir, cp):
                console.print(f"[yellow]set aside {moved}[/yellow]", soft_wrap=True)
        unpack_metrics(self.run_dir)
        truncate_metrics(self.run_dir / "metrics.jsonl", cp.env_steps)
        return state

    # --- loop helpers -------------------------------------------------------------------------------
    def __enter__(self) -> "TrainSession":
        self._stop.__enter__()
        return self

    def start(self, update: int) -> None:
        """Open the metrics file and the progress display (after `restore`, which rewrites the metrics)."""
        cfg = self.cfg
        self._ckpt_base = update
        self._writer = MetricsWriter(self.run_dir, tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project,
                                     config=dataclasses.asdict(cfg))
        self._progress = RunProgress(self.total_steps, self.title, log_every_s=cfg.log_every_s).__enter__()

    def running(self, update: int, end_update: int) -> bool:
        return update < end_update and not self._stop.requested

    def log(self, update: int, env_steps: int, metrics: dict[str, Any], **progress_fields: Any) -> dict[str, Any]:
        rec = {k: v for k, v in metrics.items() if v is not None}
        rec["update"] = update
        assert self._writer is not None and self._progress is not None, "call session.start(update) first"
        self._writer.write(env_steps, rec)
        self._progress.update(env_steps, **progress_fields)
        self.summary.update(rec)
        return rec

    def log_seeds(self, update: int, env_steps: int, records: Sequence[dict[str, Any]],
                  **progress_fields: Any) -> list[dict[str, Any]]:
        """A multi-seed run's chunk (`--num-seeds`): one metrics.jsonl record per seed carrying `seed_index`
        (the layout `thinkcraft compare` reads); TensorBoard / W&B and the summary get the mean over the
        seeds (of the keys every seed has). One record: exactly `log` (the single-seed format)."""
        if len(records) == 1:
            return [self.log(update, env_steps, records[0], **progress_fields)]
        assert self._writer is not None and self._progress is not None, "call session.start(update) first"
        out = []
        for i, metrics in enumerate(records):
            rec = {k: v for k, v in metrics.items() if v is not None}
            rec.update(update=update, seed_index=i)
            self._writer.write(env_steps, rec, external=False)
            out.append(rec)
        mean = {k: sum(r[k] for r in out) / len(out) for k in out[0]
                if k != "seed_index" and all(isinstance(r.get(k), (int, float)) for r in out)}
        self._writer.write(env_steps, mean, to_file=False)
        self._progress.update(env_steps, **progress_fields)
        self.summary.update(mean, num_seeds=len(out))
        return out

    def checkpoint_due(self, update: int, force: bool = False) -> bool:
        cfg = self.cfg
        if update == self._last_ckpt_update:
            return False
        due_u = cfg.checkpoint_every and update - self._ckpt_base >= cfg.checkpoint_every
        due_t = cfg.checkpoint_every_minutes and time.time() - self._last_ckpt_time >= 60 * cfg.checkpoint_every_minutes
        return bool(force or due_u or due_t)

    def save_checkpoint(self, update: int, env_steps: int, state: Any, params: Any = None) -> None:
        with self.timer.phase("checkpoint"):
            commit_checkpoint(self.run_dir, self.codec.encode(state, params),
                              {"update": update, "env_steps": env_steps}, keep=self.cfg.keep_checkpoints)
        self._last_ckpt_time, self._last_ckpt_update, self._ckpt_base = time.time(), update, update

    def maybe_checkpoint(self, update: int, env_steps: int, state: Any, params: Any = None, force: bool = False) -> bool:
        if not self.checkpoint_due(update, force):
            return False
        self.save_checkpoint(update, env_steps, state, params)
        return True

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(exc_type, exc, tb)
        self._stop.__exit__()
        if self._writer is not None:
            self._writer.close()
        if exc_type is None and self.cfg.plot:
            plot_curves(self.run_dir / "metrics.jsonl", self.run_dir / "curve.png", self.plot_keys,
                        title=self.title, x_label=self.x_label)
        self.summary["interrupted"] = self._stop.requested
        if exc_type is None and self._stop.requested and self._last_ckpt_update is not None:
            console.print(f"{self._stop.name}: stopped at {self.update_word} {self._last_ckpt_update:,} with a "
                          f"checkpoint; continue with: {self.resume_command}", soft_wrap=True)
