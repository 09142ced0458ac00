"""Run directories and atomic checkpoints.

Layout of `runs/<name>/`:
    config.json       the command's config (what `--resume` restores and checks)
    metrics.jsonl     one JSON record per logged chunk (see utils.metrics)
    checkpoint/       state-<update>.msgpack (full runner state: params, optimizer, env, rng)
                      params.msgpack (policy parameters alone, for eval/collect)
                      latest.json (the commit point: written last, atomically, names the state file)
    curve.png         learning curve, written at the end

A checkpoint becomes visible only when latest.json is replaced, after its files are complete; a killed
process leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

import flax.serialization
import jax
import numpy as np

from thinkcraft.utils.errors import UserError
from thinkcraft.utils.io import atomic_write_bytes, atomic_write_json


def prepare_run_dir(runs_dir: str | Path, name: str, overwrite: bool) -> Path:
    d = Path(runs_dir) / name
    if d.exists() and any(d.iterdir()):
        if not overwrite:
            raise UserError(
                f"run directory {d} already exists; pass --resume {d} to continue it or --overwrite to replace it"
            )
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    return d


def config_to_dict(cfg: Any) -> dict[str, Any]:
    assert is_dataclass(cfg)
    return json.loads(json.dumps(asdict(cfg), default=str))


def save_config(run_dir: Path, cfg: Any, extra: dict[str, Any] | None = None) -> None:
    d = config_to_dict(cfg)
    if extra:
        d["_derived"] = extra
    atomic_write_json(run_dir / "config.json", d)


def load_config_dict(run_dir: str | Path) -> dict[str, Any]:
    p = Path(run_dir) / "config.json"
    if not p.exists():
        raise UserError(f"{run_dir} is not a thinkcraft run directory (no config.json)")
    return json.loads(p.read_text())


def check_resume_compatible(saved: dict[str, Any], cfg: Any, shape_fields: tuple[str, ...], defaults: Any) -> Any:
    """Merge a resumed run's saved config with the command line.

    Fields left at their default on the command line take the saved value. A shape- or schedule-changing
    field given explicitly with a different value is an error (the run could not continue exactly)."""
    updates: dict[str, Any] = {}
    diffs = []
    for f in fields(cfg):
        if f.name not in saved:
            continue
        given, was, default = getattr(cfg, f.name), saved[f.name], getattr(defaults, f.name)
        given_j = json.loads(json.dumps(given, default=str))
        default_j = json.loads(json.dumps(default, default=str))
        if given_j == was:
            continue
        if given_j == default_j:
            updates[f.name] = was  # not given on the command line: the saved value stands
        elif f.name in shape_fields:
            diffs.append(f"{f.name}: saved {was!r}, given {given_j!r}")
    # else: a non-shape field changed on purpose (e.g. checkpoint frequency, logging): the new value stands
    if diffs:
        raise UserError(
            "cannot resume: these fields change shapes or the schedule and differ from the saved run: "
            + "; ".join(diffs)
            + ". Drop them from the command line (the saved values are used) or start a new run."
        )
    import dataclasses

    return dataclasses.replace(cfg, **updates) if updates else cfg


def save_checkpoint(run_dir: Path, state: Any, params: Any, meta: dict[str, Any], keep: int = 1) -> Path:
    ck = run_dir / "checkpoint"
    ck.mkdir(parents=True, exist_ok=True)
    step = int(meta["update"])
    state_file = ck / f"state-{step:08d}.msgpack"
    host_state = jax.device_get(state)
    atomic_write_bytes(state_file, flax.serialization.to_bytes(host_state))
    atomic_write_bytes(ck / "params.msgpack", flax.serialization.to_bytes(jax.device_get(params)))
    meta = dict(meta, state_file=state_file.name, saved_at=time.time())
    atomic_write_json(ck / "latest.json", meta)  # the commit point
    # drop older state files (only after the new one is committed)
    olds = sorted(p for p in ck.glob("state-*.msgpack") if p.name != state_file.name)
    for p in olds[: max(0, len(olds) - (keep - 1))]:
        p.unlink(missing_ok=True)
    return state_file


def latest_meta(run_dir: str | Path) -> dict[str, Any] | None:
    p = Path(run_dir) / "checkpoint" / "latest.json"
    return json.loads(p.read_text()) if p.exists() else None


def load_checkpoint(run_dir: str | Path, template: Any) -> tuple[Any, dict[str, Any]]:
    meta = latest_meta(run_dir)
    if meta is None:
        raise UserError(f"{run_dir} has no checkpoint to resume from (checkpoint/latest.json missing)")
    data = (Path(run_dir) / "checkpoint" / meta["state_file"]).read_bytes()
    state = flax.serialization.from_bytes(template, data)
    return jax.tree.map(lambda x: np.asarray(x) if not hasattr(x, "dtype") else x, state), meta


def load_params(run_dir: str | Path, template: Any) -> Any:
    p = Path(run_dir) / "checkpoint" / "params.msgpack"
    if not p.exists():
        raise UserError(f"{run_dir} has no saved policy parameters (checkpoint/params.msgpack missing)")
    return flax.serialization.from_bytes(template, p.read_bytes())
