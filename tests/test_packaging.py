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
