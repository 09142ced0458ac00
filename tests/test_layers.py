"""The package's layering, read from every module's imports (ast: lazy imports inside functions count too).

Top to bottom; a module may import only from lower layers or from its own package:

    __main__ -> cli               the entry point (`python -m thinkcraft`, the `thinkcraft` script)
    train, label, analysis        the jobs (loops, labelling, offline analysis)
    rl, llm, data                 RL maths (JAX and torch), language-model engines, the trajectory store
    envs                          Craftax (batched env, names, unroll patch, env-step scan), text/, textenvs/
    utils                         errors, io, metrics, timing, progress, plots, retries
    thinkcraft (the root)         only __version__

Inside envs: unroll -> craftax -> scan, text -> textenvs (each only imports those before it).
A new top-level package must be placed in LAYERS; an exception needs its reason here, and is removed when
the import goes (the test fails on an exception that no longer exists).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "thinkcraft"

LAYERS: dict[str, int] = {
    "__main__": 6, "cli": 5,
    "train": 4, "label": 4, "analysis": 4,
    "rl": 3, "llm": 3, "data": 3,
    "envs": 2,
    "utils": 1,
    "": 0,  # the root package (thinkcraft/__init__.py: __version__)
}
ENVS_LAYERS: dict[str, int] = {"unroll": 0, "craftax": 1, "scan": 2, "text": 2, "textenvs": 3, "": 4}

EXCEPTIONS: dict[tuple[str, str], str] = {
    ("thinkcraft.envs.textenvs.judge", "thinkcraft.llm.protocol"):
        "the LLM-judge reward calls an engine through the engine contract (plain dataclasses and a Protocol); "
        "inverting it (the judge taking a generate(prompts) -> texts callable built in train/) changes "
        "judge.py's body, which is being edited elsewhere",
    ("thinkcraft.label.collect", "thinkcraft.train.evaluate"):
        "`collect --policy ppo:<run_dir>` rolls out a `train ppo` checkpoint through eval's loader "
        "(label and train are siblings; train never imports label)",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """thinkcraft modules imported anywhere in the file (module-level or inside functions)."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # `from thinkcraft.envs import craftax`: the submodule is what is imported, not the package
            folder = SRC.parent / name.replace(".", "/")
            subs = {a.name for a in node.names if (folder / a.name).is_dir() or (folder / f"{a.name}.py").exists()}
            out |= {f"{name}.{s}" for s in subs}
            if len(subs) < len(node.names):
                out.add(name)
    return {n for n in out if n == "thinkcraft" or n.startswith("thinkcraft.")}


def _top(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def _envs_part(mod: str) -> str:
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 else ""


def _edges() -> set[tuple[str, str]]:
    return {(_module_name(p), imp) for p in SRC.rglob("*.py") for imp in _imports(p)}


def test_every_top_level_package_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
            if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    unplaced = {t for t in tops if t != "__init__" and t not in LAYERS}
    assert not unplaced, f"place these packages in LAYERS (tests/test_layers.py): {sorted(unplaced)}"


def test_every_envs_module_has_a_sublayer():
    parts = {_envs_part(_module_name(p)) for p in (SRC / "envs").rglob("*.py")}
    unplaced = parts - set(ENVS_LAYERS)
    assert not unplaced, f"place these envs modules in ENVS_LAYERS (tests/test_layers.py): {sorted(unplaced)}"


def test_imports_point_down_the_layers():
    bad = []
    for src, dst in sorted(_edges()):
        a, b = _top(src), _top(dst)
        if a == b or (src, dst) in EXCEPTIONS:
            continue
        if LAYERS[b] >= LAYERS[a]:
            bad.append(f"{src} -> {dst}  ({a or 'root'} is not above {b or 'root'})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_envs_sublayers():
    bad = []
    for src, dst in sorted(_edges()):
        if _top(src) != "envs" or _top(dst) != "envs":
            continue
        a, b = _envs_part(src), _envs_part(dst)
        if a != b and ENVS_LAYERS.get(b, 99) >= ENVS_LAYERS.get(a, -1):
            bad.append(f"{src} -> {dst}")
    assert not bad, "envs modules importing upwards (unroll -> craftax -> scan, text -> textenvs):\n" + "\n".join(bad)


def test_exceptions_are_still_needed():
    edges = _edges()
    gone = [f"{a} -> {b}" for a, b in EXCEPTIONS if (a, b) not in edges]
    assert not gone, f"remove these from EXCEPTIONS, the imports are gone: {gone}"
