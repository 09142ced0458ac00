"""The CLI shell every command shares: a closed pipe, the persistent JAX compilation cache, eval's fast refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from thinkcraft.cli import EXIT_BROKEN_PIPE, main

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu")
    env.update(extra)
    return env


@pytest.mark.parametrize("args", [["train", "ppo", "--help"], ["--help"]])
def test_help_into_a_closed_pipe_is_quiet(args):
    # `thinkcraft train ppo --help | head`: the reader is gone before the help is written
    proc = subprocess.Popen([sys.executable, "-m", "thinkcraft", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env())
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_process_cache_configuration(tmp_path, monkeypatch):
    from thinkcraft.utils import jaxcache

    for var in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(jaxcache, "DEFAULT_DIR", tmp_path / "cache")
    enabled = []  # JAX is imported in this process: the cache is also switched on directly (recorded, not done)
    monkeypatch.setattr(jaxcache, "enable_compilation_cache", enabled.append)
    path, first_use = jaxcache.configure_process_cache()
    assert path == tmp_path / "cache" and path.is_dir() and first_use and enabled == [path]
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(path)
    assert float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) == jaxcache.MIN_COMPILE_TIME_S
    (path / "entry").write_bytes(b"x")
    assert jaxcache.configure_process_cache() == (path, False)
    # a directory the user chose wins over the default
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert jaxcache.configure_process_cache()[0] == tmp_path / "mine"


@pytest.mark.slow
def test_render_fills_the_cache_once_and_reads_it_back(tmp_path):
    # a fresh cache: the first run compiles, writes its programs and says so once; the second writes nothing new
    cache = tmp_path / "jax"
    cmd = [sys.executable, "-m", "thinkcraft", "render", "--env", "craftax-classic", "--steps", "1"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=_env(JAX_COMPILATION_CACHE_DIR=str(cache)),
                           timeout=900)
    assert first.returncode == 0, first.stderr
    entries = sorted(p.name for p in cache.iterdir())
    assert any(e.startswith("jit_step") for e in entries) and any(e.startswith("jit_reset") for e in entries)
    assert first.stderr.count("compiling JAX programs once") == 1
    second = subprocess.run(cmd, capture_output=True, text=True, env=_env(JAX_COMPILATION_CACHE_DIR=str(cache)),
                            timeout=900)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert "compiling JAX programs once" not in second.stderr
    assert sorted(p.name for p in cache.iterdir()) == entries  # every program came from the cache


def _run_dir(root: Path, name: str, config: dict | str | None, checkpoint: bool = False) -> Path:
    d = root / name
    d.mkdir(parents=True)
    if config is not None:
        (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if checkpoint:
        (d / "checkpoint").mkdir()
        (d / "checkpoint" / "latest.json").write_text("{}")
        (d / "checkpoint" / "params.msgpack").write_bytes(b"")
    return d


def test_eval_refuses_what_it_cannot_evaluate_in_under_a_second(tmp_path, capsys):
    ppo = {"env_name": "Craftax-Classic-Symbolic-v1", "num_envs": 8, "_derived": {"num_updates": 4}}
    cases = {
        "missing": (tmp_path / "nope", "no such directory"),
        "not a run dir": (_run_dir(tmp_path, "plain", None), "not a run directory (no config.json)"),
        "broken config": (_run_dir(tmp_path, "torn", '{"env_na'), "config.json cannot be read"),
        "llm-policy": (_run_dir(tmp_path, "llm", {"algo": "grpo", "env": "arith"}, checkpoint=True),
                       "is a `train llm-policy` run"),
        "ppo-hidden": (_run_dir(tmp_path, "hidden", {**ppo, "skip_n": 25}, checkpoint=True),
                       "is a `train ppo-hidden` run"),
        "no checkpoint": (_run_dir(tmp_path, "fresh", ppo), "has no checkpoint"),
    }
    for what, (d, message) in cases.items():
        # the best of three: a refusal takes ~2 ms; one call can still stall for a second on a loaded 2-core CI
        # machine (a full garbage collection of the worker's heap, the other worker compiling) - that failed CI once
        seconds = []
        for _ in range(3):
            t0 = time.perf_counter()
            assert main(["eval", str(d)]) == 2, what
            seconds.append(time.perf_counter() - t0)
            err = capsys.readouterr().err
            assert message in err and len(err.strip().splitlines()) == 1, (what, err)
        assert min(seconds) < 1.0, (what, seconds)


def test_eval_refusal_imports_nothing_heavy(tmp_path):
    # in a fresh process: the refusal comes before JAX, craftax or torch are imported
    d = _run_dir(tmp_path, "llm", {"algo": "grpo"})
    code = ("import sys; from thinkcraft.cli import main; rc = main(['eval', sys.argv[1]]); "
            "print(sorted(m for m in ('jax', 'craftax', 'torch', 'flax') if m in sys.modules)); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 2 and out.stdout.strip() == "[]", (out.stdout, out.stderr)
