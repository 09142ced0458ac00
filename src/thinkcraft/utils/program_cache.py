"""Traced-program cache: identical re-runs skip tracing and lowering, not only the XLA compile.

JAX's persistent compilation cache (utils/jaxcache.py) keys programs by their lowered StableHLO, so even a
run whose every XLA program is cached still traces and lowers them first: for `train ppo`'s chunk on an
H100 (Craftax-Symbolic, its ~50 inner loops traced unrolled) that is ~21 s of a 35 s start. This cache
stores the traced program itself, with JAX's own serialization (`jax.export`; no pickled code):

    compiled = compile_cached(jax.jit(chunk, donate_argnums=0), (runner,), name="ppo-chunk",
                              donate_argnums=(0,), key_extra=program_key_config(cfg, exclude=...))
    runner, metrics = compiled(runner)        # same call and outputs as jitted.lower(runner).compile()

* What is stored, under `<JAX cache dir>/programs/` ($THINKCRAFT_PROGRAM_CACHE_DIR overrides): the FLAT
  function (argument leaves in, output leaves out) exported and serialized (`<name>-<key>.jaxexport`), and
  beside it a small JSON with the output's tree structure (node type names and their JSON-able aux data,
  e.g. the metrics dict's keys) and the bytes' sha256. Flat because custom pytree nodes (flax's TrainState
  holds its apply_fn and optimizer as aux data) cannot be serialized: a node whose aux data is not JSON
  takes it from the live arguments' nodes of the same type, or from `static_aux` (for an init, whose
  argument is only a key). A miss checks that the stored structure rebuilds the real one before writing.
* The key (`program_key`): sha256 of the jax / jaxlib / flax / optax versions, device kind and count, the
  argument leaves' key paths, shapes, dtypes, weak types and shardings, the JAX options that change a trace
  (x64, matmul precision, PRNG: `trace_flags`), `key_extra` (the config fields that shape the program: the
  whole config minus run-only fields, `program_key_config`) and a hash of every .py
  file of the thinkcraft and craftax packages (read once per process, ~0.2 s), so an edited source or
  config never reuses a stale program. The newest 16 entries of each program name are kept.
* A miss traces, exports, writes the bytes then the JSON (each to a temporary file renamed into place, the
  JSON last: it commits the entry), and compiles the DESERIALIZED export's `call` - the very module a later
  hit compiles, so that the hit's XLA compile is a persistent-cache read. A hit deserializes and compiles
  `jax.jit(exported.call, donate_argnums=...)`: no tracing of the user's function at all.
* Any failure reading or rebuilding an entry (truncated file, checksum or version skew, a type that is gone)
  is a `ProgramCacheWarning` and the function is traced as if the entry were absent: never a crash, never a
  wrong program. Arguments sharded over several devices (or several processes) bypass the cache, as do
  leaves that are not arrays. THINKCRAFT_PROGRAM_CACHE=0 turns it off.

Each call prints one line, `program cache: hit|miss|off (<name> <key> ...)` with its seconds split into
loading (or tracing and exporting) and XLA's compile or persistent-cache read (bench/startup.py reads it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any

ENV_SWITCH = "THINKCRAFT_PROGRAM_CACHE"
ENV_DIR = "THINKCRAFT_PROGRAM_CACHE_DIR"
FORMAT_VERSION = 1
SOURCE_PACKAGES = ("thinkcraft", "craftax")
VERSION_PACKAGES = ("jax", "jaxlib", "flax", "optax")
KEEP_PER_NAME = 16  # entries kept per program name: several worktrees (source hashes) may share one cache


class ProgramCacheWarning(RuntimeWarning):
    """A cache entry could not be used (or written); the program was traced instead."""


def enabled() -> bool:
    """False when $THINKCRAFT_PROGRAM_CACHE is 0 / off / false / no."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


def program_dir() -> Path:
    """$THINKCRAFT_PROGRAM_CACHE_DIR, else `programs/` in the JAX compilation cache directory."""
    from thinkcraft.utils.jaxcache import cache_dir

    return Path(os.environ.get(ENV_DIR) or cache_dir() / "programs")


def program_key_config(cfg: Any, exclude: Iterable[str]) -> dict[str, Any]:
    """A dataclass config as the key's `key_extra`: every field but `exclude` (run-only ones: run dir, seed
    when the seed is an argument, ...). A field added later is in the key by default (a miss, never stale)."""
    import dataclasses

    skip = set(exclude)
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}


@cache
def source_hash(packages: tuple[str, ...] = SOURCE_PACKAGES) -> str:
    """sha256 over every .py file (relative path and bytes) of the installed `packages`; once per process."""
    h = hashlib.sha256()
    for pkg in packages:
        spec = find_spec(pkg)
        for root in sorted(spec.submodule_search_locations or []) if spec else []:
            for path in sorted(Path(root).rglob("*.py")):
                h.update(f"{pkg}/{path.relative_to(root).as_posix()}\0".encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def versions() -> dict[str, str]:
    """Versions of the packages whose code is traced into (or serializes) the program."""
    out = {}
    for pkg in VERSION_PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


TRACE_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
               "jax_threefry_partitionable", "jax_numpy_rank_promotion")


def trace_flags() -> dict[str, str]:
    """The JAX options that change what a trace produces (X64, matmul precision, PRNG)."""
    import jax

    return {f: repr(getattr(jax.config, f, None)) for f in TRACE_FLAGS}


def program_key(name: str, leaf_specs: list[tuple], key_extra: Any, device: tuple[str, int],
                sources: str, package_versions: Mapping[str, str]) -> str:
    """The cache key (pure): sha256 of everything that shapes the traced program (see the module doc)."""
    blob = json.dumps({"format": FORMAT_VERSION, "name": name, "leaves": leaf_specs, "extra": key_extra,
                       "device": list(device), "sources": sources, "versions": dict(package_versions)},
                      sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()


# -- output tree structure <-> JSON ---------------------------------------------------------------------


class _NotJSON(Exception):
    pass


def _type_name(typ: type) -> str:
    return f"{typ.__module__}:{typ.__qualname__}"


def _aux_to_json(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [_aux_to_json(v) for v in x]
    if type(x) is tuple:
        return {"tuple": [_aux_to_json(v) for v in x]}
    raise _NotJSON


def _aux_from_json(x: Any) -> Any:
    if isinstance(x, list):
        return [_aux_from_json(v) for v in x]
    if isinstance(x, dict):
        return tuple(_aux_from_json(v) for v in x["tuple"])
    return x


def _is_leaf(td: Any) -> bool:
    return td.num_nodes == 1 and td.num_leaves == 1


def _nodes(td: Any) -> Iterable[tuple[type, Any]]:
    if not _is_leaf(td):
        yield td.node_data()
        for child in td.children():
            yield from _nodes(child)


def tree_to_json(td: Any) -> Any:
    """A PyTreeDef as JSON: "*" for a leaf, else its node type's name, aux data (or "live") and children."""
    if _is_leaf(td):
        return "*"
    typ, aux = td.node_data()
    try:
        aux_json: Any = {"value": _aux_to_json(aux)}
    except _NotJSON:
        aux_json = "live"
    return {"type": _type_name(typ), "aux": aux_json, "children": [tree_to_json(c) for c in td.children()]}


def live_nodes(trees: Iterable[Any], static_aux: Mapping[type, Any] | None = None) -> dict[str, tuple[type, Any]]:
    """Type name -> (type, aux data) of every node of `trees`' structures, and of `static_aux`."""
    import jax

    out = {_type_name(t): (t, aux) for td in map(jax.tree.structure, trees) for t, aux in _nodes(td)}
    out.update({_type_name(t): (t, aux) for t, aux in (static_aux or {}).items()})
    return out


def _resolve_type(name: str, live: Mapping[str, tuple[type, Any]]) -> type:
    if name in live:
        return live[name][0]
    if name == "builtins:NoneType":
        return type(None)
    module, qualname = name.split(":")
    obj: Any = sys.modules.get(module)  # only modules already imported: an entry never triggers an import
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        raise LookupError(f"pytree node type {name} is not loaded")
    return obj


def tree_from_json(spec: Any, live: Mapping[str, tuple[type, Any]]) -> Any:
    """Inverse of `tree_to_json`; a "live" aux is taken from `live` (`live_nodes`)."""
    import jax

    if spec == "*":
        return jax.tree.structure(0)
    typ = _resolve_type(spec["type"], live)
    if spec["aux"] == "live":
        if spec["type"] not in live:
            raise LookupError(f"no live {spec['type']} node to take its aux data from")
        aux = live[spec["type"]][1]
    else:
        aux = _aux_from_json(spec["aux"]["value"])
    children = [tree_from_json(c, live) for c in spec["children"]]
    return jax.tree_util.PyTreeDef.from_node_data_and_children(jax.tree_util.default_registry, (typ, aux), children)


# -- compile ---------------------------------------------------------------------------------------------


def _sharding(x: Any) -> Any:
    """A leaf's sharding: a jax.Array's own, the default device for a numpy array (a restored checkpoint),
    None for anything else."""
    import jax
    import numpy as np

    if isinstance(x, np.ndarray):
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return getattr(x, "sharding", None) if isinstance(x, jax.Array) else None


def leaf_specs(args: tuple) -> list[tuple] | None:
    """(key path, shape, dtype, weak type, sharding) per argument leaf; None when a leaf is not an array or
    is spread over several devices (those bypass the cache)."""
    import jax

    specs = []
    for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
        sharding = _sharding(x)
        if sharding is None or len(sharding.device_set) != 1:
            return None
        specs.append((jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype),
                      bool(getattr(jax.typeof(x), "weak_type", False)), str(sharding)))
    return specs


class CachedProgram:
    """A compiled flat program called with the original pytree arguments; returns the original outputs."""

    def __init__(self, compiled: Any, in_tree: Any, out_tree: Any, hit: bool, key: str):
        self.compiled, self.in_tree, self.out_tree, self.hit, self.key = compiled, in_tree, out_tree, hit, key

    def __call__(self, *args: Any) -> Any:
        import jax

        leaves, in_tree = jax.tree.flatten(args)
        if in_tree != self.in_tree:
            raise TypeError(f"arguments' structure changed since compile: {in_tree} vs {self.in_tree}")
        return jax.tree.unflatten(self.out_tree, self.compiled(*leaves))


def _log(msg: str) -> None:
    from thinkcraft.utils.progress import console

    console.print(f"program cache: {msg}", soft_wrap=True, highlight=False)


def _flat_donate(args: tuple, donate_argnums: Iterable[int]) -> tuple[int, ...]:
    import jax

    starts, n = [], 0
    for a in args:
        starts.append(n)
        n += len(jax.tree.leaves(a))
    return tuple(i for a in sorted(set(donate_argnums))
                 for i in range(starts[a], starts[a] + len(jax.tree.leaves(args[a]))))


def _compile_exported(exp: Any, leaves: list, donate: tuple[int, ...]) -> tuple[Any, float]:
    """The compiled `exp.call` and the seconds its XLA compile (or persistent-cache read) took."""
    import jax

    lowered = jax.jit(exp.call, donate_argnums=donate).lower(*leaves)
    t0 = time.perf_counter()
    return lowered.compile(), time.perf_counter() - t0


def _load(paths: tuple[Path, Path], leaves: list, live: dict, donate: tuple[int, ...]) -> tuple[Any, Any, float]:
    """The compiled program, output structure and XLA seconds of a stored entry (raises on anything wrong)."""
    from jax import export

    meta = json.loads(paths[1].read_text())
    blob = paths[0].read_bytes()
    if meta.get("format") != FORMAT_VERSION or hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        raise ValueError("format or checksum mismatch (a truncated or foreign file)")
    exp = export.deserialize(bytearray(blob))
    in_avals = [(tuple(a.shape), str(a.dtype)) for a in exp.in_avals]
    if in_avals != [(tuple(x.shape), str(x.dtype)) for x in leaves]:
        raise ValueError("stored argument shapes differ from the live arguments")
    out_tree = tree_from_json(meta["out_tree"], live)
    if out_tree.num_leaves != len(exp.out_avals):
        raise ValueError("stored output structure does not match the program's outputs")
    return *_compile_exported(exp, leaves, donate), out_tree


def _export_and_store(jitted_fn: Callable, args: tuple, in_tree: Any, leaves: list, donate: tuple[int, ...],
                      live: dict, paths: tuple[Path, Path], name: str) -> tuple[Any, float, Any, bool]:
    """Trace + export the flat function, write the entry if its output structure can be rebuilt, and
    compile the deserialized export. Returns (compiled, XLA seconds, output structure, written)."""
    import jax
    from jax import export

    out_trees: list[Any] = []

    def flat(*xs: Any) -> list:
        out = jitted_fn(*jax.tree.unflatten(in_tree, xs))
        out_leaves, out_tree = jax.tree.flatten(out)
        out_trees.append(out_tree)
        return out_leaves

    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_sharding(x), weak_type=jax.typeof(x).weak_type)
             for x in leaves]
    exp = export.export(jax.jit(flat, donate_argnums=donate),
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("ALL")])(*specs)
    if exp.nr_devices != 1:
        raise ValueError(f"the program spans {exp.nr_devices} devices (only single-device programs are cached)")
    blob = bytes(exp.serialize())
    out_tree = out_trees[-1]
    exp = export.deserialize(bytearray(blob))  # compile what a later hit compiles: the same XLA cache key
    out_json = tree_to_json(out_tree)
    try:
        rebuildable = tree_from_json(out_json, live) == out_tree
    except LookupError:
        rebuildable = False
    if rebuildable:
        meta = {"format": FORMAT_VERSION, "name": name, "sha256": hashlib.sha256(blob).hexdigest(),
                "out_tree": out_json, "bytes": len(blob), "created_unix_s": time.time()}
        _write_atomic(paths[0], blob)
        _write_atomic(paths[1], json.dumps(meta).encode())  # last: the JSON commits the entry
        prune(paths[1].parent, name)
    return *_compile_exported(exp, leaves, donate), out_tree, rebuildable


def prune(directory: Path, name: str, keep: int = KEEP_PER_NAME) -> None:
    """Delete all but the `keep` newest entries of `name` (each source edit makes new keys)."""
    mine = [p for p in directory.glob(f"{name}-*.json") if re.fullmatch(rf"{re.escape(name)}-[0-9a-f]{{32}}", p.stem)]
    entries = sorted(mine, key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        for p in (old.with_suffix(".jaxexport"), old):  # the JSON last, as it commits the entry
            p.unlink(missing_ok=True)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # a shared cache, as JAX's own entries
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def compile_cached(jitted_fn: Callable, args: tuple, *, name: str, donate_argnums: Iterable[int] = (),
                   key_extra: Any = None, static_aux: Mapping[type, Any] | None = None) -> Callable:
    """`jitted_fn.lower(*args).compile()`, but read from / written to the program cache (module doc).

    `jitted_fn`: a `jax.jit`-wrapped function of `args` (pytrees of arrays; its own donate_argnums are
    replaced by `donate_argnums`). `key_extra`: JSON-able values that shape the program beyond the
    arguments' shapes (`program_key_config(cfg, ...)`). `static_aux`: {pytree node type: its aux data}
    for output nodes with non-JSON aux data that the arguments do not contain. The result is called like
    the AOT-compiled function; `.hit` says whether it came from the cache."""
    import jax

    args = tuple(args)
    specs = leaf_specs(args) if enabled() else None
    if specs is None or jax.process_count() > 1:
        _log(f"off ({name}: {'disabled by ' + ENV_SWITCH if not enabled() else 'multi-device or non-array arguments'})")
        return jitted_fn.lower(*args).compile()
    t0 = time.perf_counter()
    leaves, in_tree = jax.tree.flatten(args)
    donate = _flat_donate(args, donate_argnums)
    dev = jax.devices()[0]
    key = program_key(name, specs, {"config": key_extra, "jax": trace_flags()}, (dev.device_kind, jax.device_count()),
                      source_hash(), versions())
    base = program_dir() / f"{name}-{key[:32]}"
    paths = (base.with_suffix(".jaxexport"), base.with_suffix(".json"))
    live = live_nodes(args, static_aux)
    if paths[1].exists():
        try:
            compiled, xla_s, out_tree = _load(paths, leaves, live, donate)
            total_s = time.perf_counter() - t0
            _log(f"hit ({name} {key[:12]}, {total_s:.1f} s = {total_s - xla_s:.1f} s load + {xla_s:.1f} s XLA)")
            return CachedProgram(compiled, in_tree, out_tree, True, key)
        except Exception as e:  # noqa: BLE001 - any unusable entry: trace instead (and rewrite it)
            warnings.warn(f"program cache: cannot use {paths[1].name} ({type(e).__name__}: {e}); tracing instead",
                          ProgramCacheWarning, stacklevel=2)
    try:
        compiled, xla_s, out_tree, written = _export_and_store(jitted_fn, args, in_tree, leaves, donate, live, paths,
                                                               name)
    except Exception as e:  # noqa: BLE001 - export or write failed: the plain compile still works
        warnings.warn(f"program cache: cannot export {name} ({type(e).__name__}: {e}); compiling without it",
                      ProgramCacheWarning, stacklevel=2)
        return jitted_fn.lower(*args).compile()
    total_s = time.perf_counter() - t0
    _log(f"miss ({name} {key[:12]}, {total_s:.1f} s = {total_s - xla_s:.1f} s trace and export + {xla_s:.1f} s XLA; "
         + ("saved)" if written else "not saved: its output structure cannot be rebuilt)"))
    return CachedProgram(compiled, in_tree, out_tree, False, key)


class LazyCachedKernel:
    """A jitted kernel that a loop calls (rather than compiling it ahead of time), compiled through
    `compile_cached` at its first call with that call's arguments; a call whose argument shapes or
    structure differ compiles (and caches) its own program, as `jax.jit` would."""

    def __init__(self, jitted_fn: Callable, *, name: str, donate_argnums: Iterable[int] = (),
                 key_extra: Any = None) -> None:
        self.jitted_fn, self.name, self.donate_argnums = jitted_fn, name, tuple(donate_argnums)
        self.key_extra = key_extra
        self._programs: dict[Any, Callable] = {}

    def __call__(self, *args: Any) -> Any:
        import jax

        leaves, tree = jax.tree.flatten(args)
        sig = (tree, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x)))) for x in leaves))
        program = self._programs.get(sig)
        if program is None:
            program = self._programs[sig] = compile_cached(
                self.jitted_fn, args, name=self.name, donate_argnums=self.donate_argnums, key_extra=self.key_extra)
        return program(*args)
