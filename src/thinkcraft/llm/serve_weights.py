"""`thinkcraft serve`'s weight-update endpoint: a learner on another process or machine writes its weights to
a file and tells the server to load them, with a version.

    POST /update_weights   {"path": "/runs/x/weights-v00000007.pt", "version": 7}
                           -> {"success": true, "version": 7, "message": "..."}
    GET  /weights_version  -> {"version": 7}

The file is a thinkcraft weight file (llm/weight_files.py): {"version", "kind", "state", "meta"}. kind "full": parameters by name, copied into the served model. kind "lora": PEFT adapter
tensors (`...<module>.lora_A.<adapter>.weight`, `...lora_B...`) and meta["lora_scaling"] (alpha / r); the
server keeps the base weights of the adapted linears and serves W = W_base + scaling · B @ A.

Atomic: the load runs under the engine lock (between two generate calls), and every tensor's name and shape
is checked before any weight changes, so a bad file leaves the previous weights and version whole (the
answer is a 400/409 that says why). Idempotent: loading the version already held is a success with no work
(a client may retry after a lost answer); an older version is refused (409).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from thinkcraft.llm.serve_requests import RequestError
from thinkcraft.llm.weight_files import read_weight_file

_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class WeightLoader:
    """Loads versioned weight files into an HFEngine's model (call under the engine lock)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.version = 0
        self._base: dict[str, Any] = {}  # LoRA-adapted linear weights as first served (CPU)

    def load(self, path: str, version: int) -> str:
        import torch

        if version < self.version:
            raise RequestError(f"version {version} is older than the served version {self.version}", "version",
                               status=409, code="stale_version")
        if version == self.version:
            return f"version {version} already served"
        p = Path(path)
        if not p.is_file():
            raise RequestError(f"no weight file at {path} (the path is read by the server)", "path")
        try:
            data = read_weight_file(p)
        except Exception as e:  # noqa: BLE001 - a torn or foreign file
            raise RequestError(f"cannot read {path}: {type(e).__name__}: {e}", "path") from None
        if int(data.get("version", version)) != version:
            raise RequestError(f"{path} holds version {data.get('version')}, not {version}", "version", status=409,
                               code="version_mismatch")
        kind = data.get("kind", "full")
        named = dict(self.engine.model.named_parameters())
        if kind == "full":
            updates = self._full(data["state"], named)
        elif kind == "lora":
            updates = self._lora(data["state"], float((data.get("meta") or {}).get("lora_scaling", 1.0)), named)
        else:
            raise RequestError(f"unknown weight kind {kind!r} (full or lora)", "path")
        with torch.no_grad():
            for name, value in updates.items():
                named[name].copy_(value.to(named[name].device, named[name].dtype))
        self.engine.invalidate_prefix_cache()
        self.version = version
        return f"loaded {len(updates)} tensors ({kind}) as version {version}"

    @staticmethod
    def _check(name: str, shape: tuple[int, ...], named: dict[str, Any]) -> None:
        if name not in named:
            raise RequestError(f"the served model has no parameter {name!r}", "path", code="unknown_parameter")
        if tuple(named[name].shape) != tuple(shape):
            raise RequestError(f"{name}: shape {tuple(shape)} in the file, {tuple(named[name].shape)} served",
                               "path", code="shape_mismatch")

    def _full(self, state: dict[str, Any], named: dict[str, Any]) -> dict[str, Any]:
        for n, v in state.items():
            self._check(n, tuple(v.shape), named)
        return dict(state)

    def _lora(self, state: dict[str, Any], scaling: float, named: dict[str, Any]) -> dict[str, Any]:
        pairs: dict[str, dict[str, Any]] = {}
        for key, v in state.items():
            m = _LORA_KEY.match(key)
            if m is None:
                raise RequestError(f"{key!r} is not a LoRA adapter tensor (…lora_A/lora_B…weight)", "path")
            pairs.setdefault(m.group("module"), {})[m.group("ab")] = v
        out = {}
        for module, ab in pairs.items():
            if set(ab) != {"A", "B"}:
                raise RequestError(f"LoRA module {module} lacks lora_{'B' if 'A' in ab else 'A'}", "path")
            name = f"{module}.weight"
            delta = scaling * (ab["B"].float() @ ab["A"].float())
            self._check(name, tuple(delta.shape), named)
            out[name] = delta
        for name, delta in out.items():  # every check passed: W = W_base + delta
            if name not in self._base:
                self._base[name] = named[name].detach().to("cpu", copy=True)
            out[name] = self._base[name].float() + delta
        return out


class WeightRoutes:
    """The two routes over a ServedEngine (its lock serialises a load with generation)."""

    def __init__(self, srv: Any) -> None:
        self.srv = srv
        self.loader = WeightLoader(srv.engine)

    async def update_weights(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("path"), str):
            raise RequestError("the body needs 'path' (a weight file the server can read) and 'version'", "path")
        version = body.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise RequestError("'version' must be an integer >= 0", "version")
        message = await self.srv.call(self.loader.load, body["path"], version)
        return {"success": True, "version": self.loader.version, "message": message}

    def version(self) -> dict[str, Any]:
        return {"version": self.loader.version}
