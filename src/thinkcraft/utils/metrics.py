"""Metrics sink: append-only JSONL (always) plus optional TensorBoard and Weights & Biases.

Each record is one flat dict `{"step": env_steps, "time_s": ..., "<group>/<name>": value}`; names are
grouped as in CleanRL (`episode/…`, `losses/…`, `timing/…`, `achievements/…`). JSONL lines are
flushed per write, so a killed run keeps every complete line; `read_metrics` skips a torn last line.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping


def _to_float(v: Any) -> float | int | None:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v if not (isinstance(v, float) and math.isnan(v)) else None
    return None


class MetricsWriter:
    def __init__(
        self,
        run_dir: str | os.PathLike,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        config: Mapping[str, Any] | None = None,
        filename: str = "metrics.jsonl",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / filename
        self._f = open(self.path, "a", encoding="utf-8")
        self._t0 = time.time()
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # type: ignore
            except Exception:
                try:
                    from tensorboardX import SummaryWriter  # type: ignore
                except Exception as e:  # pragma: no cover - depends on extras
                    raise RuntimeError(
                        "tensorboard logging needs `pip install 'thinkcraft[tensorboard]'`"
                    ) from e
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        if wandb_project:
            try:
                import wandb  # type: ignore
            except ImportError as e:
                raise RuntimeError("W&B logging needs `pip install 'thinkcraft[wandb]'`") from e
            self._wandb = wandb.init(project=wandb_project, name=self.run_dir.name,
                                     config=dict(config or {}), dir=str(self.run_dir))

    def write(self, step: int, metrics: Mapping[str, Any], to_file: bool = True, external: bool = True
              ) -> dict[str, Any]:
        """One record; `to_file` / `external`: to the JSONL / to TensorBoard and W&B (a multi-seed run
        writes each seed's record to the file and their mean to the others, which keep one value per step)."""
        rec: dict[str, Any] = {"step": int(step), "time_s": round(time.time() - self._t0, 3)}
        for k, v in metrics.items():
            f = _to_float(v)
            if f is not None:
                rec[k] = f
        if to_file:
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()
        if not external:
            return rec
        if self._tb is not None:
            for k, v in rec.items():
                if k not in ("step",):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(rec, step=int(step))
        return rec

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


METRICS_FILES = ("metrics.jsonl", "metrics.jsonl.gz")
"""A run directory's metrics: plain, or gzip-compressed where a finished run was archived (the benchmark runs kept
in the repository: ~5x smaller)."""


def run_metrics_path(run_dir: str | os.PathLike) -> Path | None:
    """A run directory's metrics file (`METRICS_FILES`, the plain one first), else None."""
    for name in METRICS_FILES:
        if (Path(run_dir) / name).exists():
            return Path(run_dir) / name
    return None


def _metrics_bytes(p: Path) -> bytes:
    if p.suffix == ".gz":
        import gzip

        return gzip.decompress(p.read_bytes())
    return p.read_bytes()


def unpack_metrics(run_dir: str | os.PathLike) -> None:
    """A resumed run whose metrics were archived compressed (`metrics.jsonl.gz` alone) gets its `metrics.jsonl`
    back before it appends to it: one file, never a compressed head and a plain tail."""
    plain, gz = (Path(run_dir) / name for name in METRICS_FILES)
    if gz.exists() and not plain.exists():
        tmp = plain.with_suffix(".jsonl.tmp")
        tmp.write_bytes(_metrics_bytes(gz))
        os.replace(tmp, plain)
        gz.unlink()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a metrics.jsonl (or a gzip-compressed `.gz` one), ignoring a torn (partially written) last line."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in _metrics_bytes(p).decode("utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def truncate_metrics(path: str | os.PathLike, max_step: int) -> None:
    """Drop records past `max_step` (used on resume so the file matches the checkpoint)."""
    recs = [r for r in read_metrics(path) if r.get("step", 0) <= max_step]
    from thinkcraft.utils.io import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in recs))

