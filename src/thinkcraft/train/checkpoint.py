"""Run directories and verified, atomic checkpoints (one module for the JAX loops and the torch one).

Layout of a run directory:
    config.json            the command's config (what `--resume` restores and checks)
    metrics.jsonl          one JSON record per logged chunk (see utils.metrics)
    checkpoint/
        00000004/          one directory per checkpoint, named by its update (learner step for llm-policy)
            state.msgpack  the full loop state (JAX: flax serialization; torch: state.pt from torch.save)
            params.msgpack the policy parameters alone (JAX loops; what `eval` and `collect` read)
            manifest.json  {update, env_steps, files: {name: {bytes, sha256}}, saved_at}
        latest.json        the commit point: the newest checkpoint's manifest plus its directory name
    curve.png              learning curve, written at the end

Writing: the files go to a '.tmp-' directory, which is renamed into place once complete; latest.json is
replaced (atomically) last, then all but the newest `keep` checkpoints are deleted. A process killed at any
point leaves the previous checkpoint intact and named by latest.json.

Reading (`read_checkpoint`): every file is checked against the sha256 and size its manifest recorded
before anything uses it, so a truncated, missing or bit-flipped file is one error naming that file, never
a deserialization traceback or, worse, training resumed from corrupted weights. With `fallback=True` the
newest older checkpoint that verifies is used instead (and the bad ones are set aside by `adopt`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from thinkcraft.utils.errors import UserError
from thinkcraft.utils.io import atomic_write_json, fsync_dir

CHECKPOINT_DIR = "checkpoint"
LATEST = "latest.json"
MANIFEST = "manifest.json"


class CheckpointError(UserError):
    """A checkpoint file is missing, truncated or changed since it was written (the message names it)."""


# ============================================================================================ configs


def config_to_dict(cfg: Any) -> dict[str, Any]:
    assert is_dataclass(cfg)
    return json.loads(json.dumps(asdict(cfg), default=str))


def save_config(run_dir: Path, cfg: Any, extra: dict[str, Any] | None = None) -> None:
    d = config_to_dict(cfg)
    if extra:
        d["_derived"] = extra
    atomic_write_json(Path(run_dir) / "config.json", d)


def load_config_dict(run_dir: str | Path) -> dict[str, Any]:
    p = Path(run_dir) / "config.json"
    if not p.exists():
        raise UserError(f"{run_dir} is not a thinkcraft run directory (no config.json)")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{p} is not valid JSON ({e})") from None


def check_resume_compatible(saved: dict[str, Any], cfg: Any, shape_fields: Sequence[str], defaults: Any,
                            skip: Sequence[str] = ()) -> Any:
    """Merge a resumed run's saved config with the command line.

    Fields left at their default on the command line take the saved value. A shape- or schedule-changing
    field given explicitly with a different value is an error (the run could not continue exactly).
    Fields in `skip` (where the run lives, how to resume it) are the command line's alone."""
    updates: dict[str, Any] = {}
    diffs = []
    for f in fields(cfg):
        if f.name not in saved or f.name in skip:
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
    return dataclasses.replace(cfg, **updates) if updates else cfg


# ============================================================================================ codecs


class Codec(NamedTuple):
    """How a loop's state becomes checkpoint files and back.

    encode(state, params) -> {file name: bytes}; decode(files, template) -> state. `template` is what the
    decoder needs to rebuild the structure (JAX: a pytree of the state's shapes; torch: unused)."""

    encode: Callable[[Any, Any], dict[str, bytes]]
    decode: Callable[[dict[str, bytes], Any], Any]
    state_file: str


def _jax_encode(state: Any, params: Any) -> dict[str, bytes]:
    import flax.serialization
    import jax

    files = {"state.msgpack": flax.serialization.to_bytes(jax.device_get(state))}
    if params is not None:
        files["params.msgpack"] = flax.serialization.to_bytes(jax.device_get(params))
    return files


def _jax_decode(files: dict[str, bytes], template: Any) -> Any:
    import flax.serialization

    return flax.serialization.from_bytes(template, files["state.msgpack"])


def _torch_encode(state: Any, params: Any) -> dict[str, bytes]:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return {"state.pt": buf.getvalue()}


def _torch_decode(files: dict[str, bytes], template: Any) -> Any:
    import torch

    # our own file, verified against its manifest; it holds numpy/python RNG states (not weights-only)
    return torch.load(io.BytesIO(files["state.pt"]), map_location="cpu", weights_only=False)


JAX_CODEC = Codec(_jax_encode, _jax_decode, "state.msgpack")
TORCH_CODEC = Codec(_torch_encode, _torch_decode, "state.pt")


# ============================================================================================ writing


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def checkpoint_name(update: int) -> str:
    return f"{int(update):08d}"


def commit_checkpoint(run_dir: str | Path, files: dict[str, bytes], meta: dict[str, Any], keep: int = 2) -> Path:
    """Write one checkpoint (files + manifest), commit it in latest.json, keep the newest `keep`."""
    ck = Path(run_dir) / CHECKPOINT_DIR
    ck.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(meta["update"])
    manifest = dict(meta, saved_at=time.time(),
                    files={n: {"bytes": len(b), "sha256": _sha256(b)} for n, b in sorted(files.items())})
    tmp = ck / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for n, b in files.items():
        _write_synced(tmp / n, b)
    _write_synced(tmp / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    final = ck / name
    if final.exists():  # a checkpoint of this update from an abandoned branch of the run (after a fallback)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(ck)
    atomic_write_json(ck / LATEST, dict(manifest, checkpoint=name))  # the commit point
    for old in _checkpoint_dirs(ck)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ck.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _checkpoint_dirs(ck: Path) -> list[Path]:
    """Checkpoint directories, newest (highest update) first."""
    if not ck.is_dir():
        return []
    return sorted((p for p in ck.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name),
                  reverse=True)


# ============================================================================================ reading


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: its directory, manifest and file contents."""

    dir: Path
    meta: dict[str, Any]
    files: dict[str, bytes]

    @property
    def update(self) -> int:
        return int(self.meta["update"])

    @property
    def env_steps(self) -> int:
        return int(self.meta["env_steps"])


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"{path} is missing")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt (not valid JSON: {e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("files"), dict) or "update" not in d:
        raise CheckpointError(f"{path} is not a checkpoint manifest (no file checksums; written by an older "
                              "thinkcraft?)")
    return d


def _verify(d: Path, meta: dict[str, Any], names: Sequence[str] | None = None) -> Checkpoint:
    files: dict[str, bytes] = {}
    for name, rec in meta["files"].items():
        if names is not None and name not in names:
            continue
        p = d / name
        if not p.exists():
            raise CheckpointError(f"{p} is missing")
        data = p.read_bytes()
        if len(data) != rec["bytes"]:
            raise CheckpointError(f"{p} is truncated or damaged ({len(data):,} bytes, {rec['bytes']:,} written)")
        if _sha256(data) != rec["sha256"]:
            raise CheckpointError(f"{p} is corrupt (its sha256 differs from the one recorded when it was written)")
        files[name] = data
    if names is not None and not set(names) <= set(files):
        raise CheckpointError(f"{d} holds no {', '.join(sorted(set(names) - set(files)))}")
    return Checkpoint(d, meta, files)


def has_checkpoint(run_dir: str | Path) -> bool:
    ck = Path(run_dir) / CHECKPOINT_DIR
    return (ck / LATEST).exists() or bool(_checkpoint_dirs(ck))


def read_checkpoint(run_dir: str | Path, fallback: bool = False, names: Sequence[str] | None = None
                    ) -> tuple[Checkpoint, list[str]]:
    """The newest committed checkpoint, verified, and the problems of the newer ones skipped on the way
    (only with `fallback`: the newest older checkpoint that verifies; without it the first problem is
    raised). `names`: verify and read only these files."""
    ck = Path(run_dir) / CHECKPOINT_DIR
    if not has_checkpoint(run_dir):
        raise UserError(f"{run_dir} has no checkpoint (nothing in {ck})")
    latest_update: int | None = None
    try:
        meta = _read_json(ck / LATEST)
        latest_update = int(meta["update"])
        d = ck / str(meta.get("checkpoint", ""))
        if not meta.get("checkpoint") or not d.is_dir():
            raise CheckpointError(f"{ck / LATEST} names checkpoint {meta.get('checkpoint')!r}, which is missing")
        return _verify(d, meta, names), []
    except CheckpointError as e:
        first = str(e)
    # committed checkpoints other than the one that failed (a directory newer than latest.json's was never
    # committed); when latest.json itself is unreadable, every one
    others = [d for d in _checkpoint_dirs(ck) if latest_update is None or int(d.name) < latest_update]
    if not fallback:
        hint = (f" Pass --resume-fallback to resume from the newest other checkpoint that verifies "
                f"({len(others)} left), or start again with --overwrite" if others
                else " Start again with --overwrite")
        raise CheckpointError(f"{first}.{hint}") from None
    problems = [first]
    for d in others:
        try:
            return _verify(d, _read_json(d / MANIFEST), names), problems
        except CheckpointError as e:
            problems.append(str(e))
    raise CheckpointError(f"{first}; and no other checkpoint in {ck} verifies either") from None


def adopt(run_dir: str | Path, chosen: Checkpoint) -> list[Path]:
    """After a fallback: set aside every checkpoint newer than `chosen` (renamed `corrupt-<name>`, kept for
    inspection) and make latest.json name `chosen`. Returns the paths set aside."""
    ck = Path(run_dir) / CHECKPOINT_DIR
    moved = []
    for d in _checkpoint_dirs(ck):
        if int(d.name) > chosen.update:
            dest = ck / f"corrupt-{d.name}-{int(time.time())}"
            os.replace(d, dest)
            moved.append(dest)
    atomic_write_json(ck / LATEST, dict(chosen.meta, checkpoint=chosen.dir.name))
    return moved


def latest_meta(run_dir: str | Path) -> dict[str, Any] | None:
    """The newest checkpoint's manifest, unverified (None when there is none); for quick looks."""
    p = Path(run_dir) / CHECKPOINT_DIR / LATEST
    return json.loads(p.read_text()) if p.exists() else None


def load_params(run_dir: str | Path, template: Any) -> Any:
    """The policy parameters of a JAX run's newest checkpoint (verified), shaped like `template`."""
    import flax.serialization

    cp, _ = read_checkpoint(run_dir, names=("params.msgpack",))
    return flax.serialization.from_bytes(template, cp.files["params.msgpack"])


# what a training run leaves in its directory: --overwrite deletes a directory holding only these
RUN_DIR_ENTRIES = frozenset({"config.json", "metrics.jsonl", CHECKPOINT_DIR, "curve.png", "trajectories", "tb",
                             "wandb", "eval.json"})


def prepare_run_dir(d: Path, overwrite: bool) -> Path:
    """A fresh run directory: refuse an existing non-empty one unless `overwrite` (then empty it; only a
    directory that looks like a run's - a mistyped --run-dir . --overwrite must not delete a project)."""
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        if not overwrite:
            raise UserError(f"run directory {d} already exists; pass --resume --run-dir {d} to continue it, "
                            "--overwrite to replace it, or another --run-dir/--run-name")
        other = sorted(p.name for p in d.iterdir() if p.name not in RUN_DIR_ENTRIES) if d.is_dir() else [d.name]
        if other:
            raise UserError(f"--overwrite: {d} holds {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}, which "
                            "no training run writes; not deleting it (remove it yourself or pick another --run-dir)")
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    return d
