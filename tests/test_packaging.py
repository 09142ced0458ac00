"""pyproject.toml: metadata that installs without deprecation warnings, and the registered test markers."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_license_is_an_spdx_string_and_setuptools_does_not_warn():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert not [w for w in caught if "license" in str(w.message)], [str(w.message)[:200] for w in caught]
    assert dist.metadata.license_expression == "Apache-2.0"


def test_markers_registered():
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":")[0] for m in markers} >= {"slow", "gpu"}


def test_gpu_only_tests_carry_the_gpu_mark():
    # a test that skips without CUDA is GPU-only: `-m gpu` selects exactly those (on a GPU machine) and
    # `-m "not gpu"` leaves them out on a CPU
    import ast

    unmarked = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            if node.name == "test_gpu_only_tests_carry_the_gpu_mark":  # its own text names what it looks for
                continue
            text = " ".join(ast.unparse(d) for d in node.decorator_list) + ast.unparse(node)
            skips_without_cuda = "skip" in text and any(w in text for w in ("cuda.is_available()", "platform != 'gpu'"))
            marked = any(ast.unparse(d) == "pytest.mark.gpu" for d in node.decorator_list)
            if skips_without_cuda and not marked:
                unmarked.append(f"{path.name}::{node.name}")
    assert not unmarked, unmarked
