"""Shared test setup: one persistent JAX compilation cache for the whole suite (and across runs)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from thinkcraft.utils.jaxcache import enable_compilation_cache  # noqa: E402

enable_compilation_cache()


import pytest  # noqa: E402

from servers import Servers  # noqa: E402


@pytest.fixture
def servers():
    """Start test servers on free ports, waited for: `servers.app(asgi_app)` (uvicorn in a thread) or
    `servers.serve(*args)` (`thinkcraft serve` as a process); each returns its base URL. All are stopped
    after the test."""
    s = Servers()
    yield s
    s.close()


@pytest.fixture(scope="module")
def module_servers():
    """`servers`, shared by the tests of one module (e.g. one model load for many tests)."""
    s = Servers()
    yield s
    s.close()
