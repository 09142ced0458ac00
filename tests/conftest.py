"""Shared test setup: one persistent JAX compilation cache for the whole suite (and across runs)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".cache" / "jax"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the training loops freeze the heap after their first step (utils/gc_clock.py): not a test worker's whole heap,
# whose later tests' cycles would then never be collected (tests/test_host_overheads.py tests the freeze itself)
os.environ.setdefault("THINKCRAFT_GC_FREEZE", "0")
if os.environ["JAX_PLATFORMS"] == "cpu":
    # The suite's Craftax programs are compile-bound (tiny shapes, a few steps): XLA's CPU backend without its
    # expensive LLVM passes compiles them ~30-40% faster (a Classic PPO-RNN run 127 -> 77 s on the 2-core CI
    # machine). Both sides of every equality test are compiled alike; subprocesses inherit it. A GPU run of
    # the suite (JAX_PLATFORMS unset) keeps full optimisation; JAX_DISABLE_MOST_OPTIMIZATIONS=0 opts out.
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

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


# The longest test files first (their minutes on a 2-core CPU, 2026-11-28), then the rest in their usual order:
# `make test` hands whole files to two workers as they free up (pytest-xdist --dist loadfile), and a long file
# taken last runs on alone while the other worker idles (a 42-minute run had ~10 minutes of that).
HEAVY_FIRST = ("test_sharding", "test_sharding_runs", "test_seeds", "test_rnn", "test_ppo_hidden", "test_program_cache",
               "test_feature_engines", "test_train_ppo", "test_hidden_pool", "test_llm_packed", "test_demo",
               "test_envs", "test_llm_batching", "test_pools_ray", "test_async_faults", "test_label_serve")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each file keeps its order
