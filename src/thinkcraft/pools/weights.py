"""Learner -> engine weights, versioned. One `WeightUpdate` per learner step; a `WeightSync` per engine
applies it (between batches, or between decode steps with the engine hook of issue 19) and reports the
version the engine actually holds.

- `SharedWeights`: the engine reads the learner's own parameters (no copy). The learner changes them under
  the engine slot's lock and sets the version in the same critical section, so a batch never mixes
  versions; generation and training take turns on the device.
- `CopyWeights`: the engine has its own copy of the model (same or another device). `apply` checks every
  tensor (name, shape) before copying any, so a bad update leaves the old weights whole (atomic); an update
  not newer than the engine's version is ignored (the version check). LoRA runs ship the adapters only.

An engine with versioned weights (`Capabilities.versioned_weights`, the llm/hf decode engine) takes both
through its own `update_weights(state, version)` (`engine_update`): the tensors (None for shared parameters:
only the version moves) at a decode-step boundary, all-or-nothing, every generated token recording its
version. The engine refuses a version not newer than its own with `StaleWeightsError`: that update is
skipped, never a failure (the engine already holds these weights or newer ones: a retry after an answer
lost in a timeout, or a newer update queued first).
- `HTTPWeights`: the learner writes the state to a file (atomically, llm/weight_files.py) and the engine's server
  loads it
  (`thinkcraft serve` POST /update_weights, SGLang /update_weights_from_disk, vLLM /collective_rpc or
  /v1/load_lora_adapter: llm/clients.py); the server's reported version is checked after the call.

`trainable_state(model, lora)` is what the learner publishes: the adapters when training LoRA, else every
parameter. Tensors are detached CPU copies: picklable, so a Ray backend can ship the same value.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightUpdate:
    version: int
    """Learner updates done: the version these weights are."""
    state: dict[str, Any] | None = None
    """name -> tensor (CPU); None for shared-parameter engines."""
    kind: Literal["full", "lora"] = "full"
    path: str | None = None
    """Where the state was written for engines that load from disk (HTTP)."""
    meta: dict[str, Any] | None = None
    """LoRA: {"lora_scaling": alpha / r, "peft_config": the adapter's PEFT config as a dict}."""


class WeightSync(Protocol):
    @property
    def version(self) -> int: ...

    def apply(self, update: WeightUpdate) -> None:
        """Take `update` (raise on failure, keeping the previous weights and version)."""
        ...


def trainable_state(model: Any, lora: bool, device: str | None = "cpu", like: Any = None) -> dict[str, Any]:
    """Detached copies of what changes in training: LoRA adapter tensors, or every parameter. On the CPU by
    default (picklable: any backend can ship them); `device=None` keeps them on the learner's device, for
    in-process engine copies on other GPUs (a device-to-device copy, peer-to-peer over NVLink where there is one).
    `like` (an in-process engine's own model; overrides `device`): each tensor copied to the device and dtype that
    model holds it in (llm.hf.weights.staged_like), by the learner's thread in its stream order - so the
    engine's update at a decode-step boundary is one grouped local copy, not a cast and a peer-to-peer copy per
    tensor made while it stands still."""
    items = [(n, p) for n, p in model.named_parameters() if (p.requires_grad if lora else True)]
    if like is not None:
        from thinkcraft.llm.hf.weights import staged_like

        return staged_like(items, like)
    return {n: (p.detach().clone() if device is None else p.detach().to(device, copy=True)) for n, p in items}


def versioned(engine: Any) -> bool:
    """The engine takes weights through a versioned `update_weights(state, version)` (llm.protocol)."""
    caps = getattr(engine, "capabilities", None)
    return bool(getattr(caps, "versioned_weights", False)) and callable(getattr(engine, "update_weights", None))


def engine_update(engine: Any, state: dict[str, Any] | None, version: int) -> bool:
    """`engine.update_weights(state, version)` of a versioned engine; False (nothing done) when the engine
    holds or has queued this version or a newer one (`StaleWeightsError`, or seen before the call). Any other
    refusal raises WeightUpdateError, the engine keeping its weights and version."""
    from thinkcraft.llm.protocol import StaleWeightsError

    held = int(engine.weights_version)
    if version <= held:
        log.info("weight update to version %d skipped: the engine already holds version %d", version, held)
        return False
    try:
        engine.update_weights(state, version)
    except StaleWeightsError as e:
        log.info("weight update to version %d skipped: %s", version, e)
        return False
    return True


class SharedWeights:
    """The engine shares the learner's parameters; the version is set by the learner (`set_version`, under
    the slot's lock, in the same critical section as the optimizer step). A versioned `engine` moves its own
    version with it (no tensors: they changed in place), inside `context` (the engine's autocast)."""

    def __init__(self, version: int = 0, engine: Any = None, context: Any = None) -> None:
        self._version = version
        self.engine = engine if versioned(engine) else None
        self.context = context
        if self.engine is not None and version > 0:
            self._advance_engine(version)  # a resumed run: the engine's tokens carry the learner's versions

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        if self.engine is not None:
            self._advance_engine(version)
        self._version = version

    def _advance_engine(self, version: int) -> None:
        import contextlib

        with self.context() if self.context is not None else contextlib.nullcontext():
            engine_update(self.engine, None, version)

    def apply(self, update: WeightUpdate) -> None:
        self._version = max(self._version, update.version)


class CopyWeights:
    """An engine model with its own weights, updated by copy (adapters only for LoRA): through a versioned
    `engine`'s own update_weights (`engine_update`), else copied into `model` here (llm.hf.weights.apply_state:
    checked whole before any copy) and `on_change` called."""

    def __init__(self, model: Any, version: int = 0, on_change: Any = None, engine: Any = None) -> None:
        self.model = model
        self._version = version
        self.on_change = on_change
        """Called after the weights changed (e.g. the engine's invalidate_prefix_cache)."""
        self.engine = engine if versioned(engine) else None
        if self.engine is not None and version > 0:
            engine_update(self.engine, None, version)  # same weights as the learner's at `version`: the label

    @property
    def version(self) -> int:
        return self._version

    def apply(self, update: WeightUpdate) -> None:
        from thinkcraft.llm.hf.weights import apply_state

        if update.version <= self._version:
            return  # an old or repeated update: the engine already holds newer weights
        if update.state is None:
            raise ValueError(f"weight update {update.version} carries no tensors for an in-process copy")
        if self.engine is not None:
            engine_update(self.engine, update.state, update.version)
        else:
            apply_state(self.model, update.state, update.version)
            if self.on_change is not None:
                self.on_change()
        self._version = update.version


class HTTPWeights:
    """Weights through a server's own update endpoint: the learner's file, then a versioned load call.

    `client.write(update, out_dir) -> path` writes the update in the server's format;
    `client.update_weights(path, version, kind)` must raise when the server refuses or fails; the version
    the server reports afterwards (`client.weights_version()`, None when it keeps none) is checked, so a call
    that answered 200 without loading is a failure.
    """

    def __init__(self, client: Any, out_dir: Path, version: int = 0, keep_files: int = 2) -> None:
        self.client = client
        self.out_dir = Path(out_dir)
        self._version = version
        self.keep_files = keep_files

    @property
    def version(self) -> int:
        return self._version

    def apply(self, update: WeightUpdate) -> None:
        if update.version <= self._version:
            return
        path = update.path or self.client.write(update, self.out_dir)
        self.client.update_weights(str(path), update.version, update.kind)
        got = self.client.weights_version()
        if got is not None and int(got) != update.version:
            raise RuntimeError(f"the server answered the update to version {update.version} but reports version {got}")
        self._version = update.version
        for pattern in ("weights-v*.pt", "hf-v*"):  # older files: the server has loaded a newer one
            for old in sorted(self.out_dir.glob(pattern))[: -self.keep_files]:
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)
