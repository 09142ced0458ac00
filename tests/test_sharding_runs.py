"""`--devices 2` end to end: `train ppo` runs, resumes and evaluates; ppo-hidden equals the same program on one
device. The checks live in tests/test_sharding.py (`check_train_ppo`, `check_ppo_hidden`) and run in a
subprocess with 2 forced host devices (`run_check`); this file holds only the tests, so that CI's two pytest
workers (`--dist loadfile`: a file per worker) can run them beside test_sharding.py's own checks instead of
after them (together one file took ~25 of a 42-minute run on one worker, 2026-11-28)."""

from __future__ import annotations

import pytest

from test_sharding import run_check


@pytest.mark.slow
def test_train_ppo_devices_2_runs_resumes_and_evaluates(tmp_path):
    assert "ok" in run_check("train_ppo", str(tmp_path / "run"), devices=2)


@pytest.mark.slow
def test_ppo_hidden_devices_2_equals_the_same_program_on_one_device(tmp_path):
    out = run_check("ppo_hidden", str(tmp_path), devices=2)
    assert out.count("ok") == 2, out
