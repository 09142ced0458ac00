"""utils.errors.env_int: the whole-number settings read from the environment (THINKCRAFT_PREFILL_GRAPH_TOKENS,
THINKCRAFT_FUSED_TOKENS_MAX, THINKCRAFT_SPLIT_PREFIX_ROWS)."""

import os
import subprocess
import sys

import pytest

from thinkcraft.llm.hf.prefill_graphs import MAX_TOKENS, PrefillGraphs
from thinkcraft.utils.errors import UserError, env_int


def test_env_int_reads_defaults_and_refuses_bad_values(monkeypatch):
    monkeypatch.delenv("TC_TEST_INT", raising=False)
    assert env_int("TC_TEST_INT", 7) == 7
    monkeypatch.setenv("TC_TEST_INT", " ")
    assert env_int("TC_TEST_INT", 7) == 7
    monkeypatch.setenv("TC_TEST_INT", "32768")
    assert env_int("TC_TEST_INT", 7, least=1) == 32768
    monkeypatch.setenv("TC_TEST_INT", "1.5")
    with pytest.raises(UserError, match="whole number"):
        env_int("TC_TEST_INT", 7)
    monkeypatch.setenv("TC_TEST_INT", "0")
    with pytest.raises(UserError, match=">= 1"):
        env_int("TC_TEST_INT", 7, least=1)
    pow2 = dict(least=0, most=8, check=lambda n: n & (n - 1) == 0, wanted="0 or a power of two up to 8")
    for good in ("0", "1", "8"):
        monkeypatch.setenv("TC_TEST_INT", good)
        assert env_int("TC_TEST_INT", 2, **pow2) == int(good)
    for bad in ("3", "16", "-2", "x"):  # one message for every bad value: the check's, the range's, a non-number
        monkeypatch.setenv("TC_TEST_INT", bad)
        with pytest.raises(UserError, match=f"TC_TEST_INT must be 0 or a power of two up to 8, got '{bad}'"):
            env_int("TC_TEST_INT", 2, **pow2)


def test_fused_tokens_max_is_read_at_import():
    code = ("from thinkcraft.llm.hf import triton_device as t; "
            "print(t.FUSED_TOKENS_MAX, t.fused_size(99), t.fused_size(100))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "THINKCRAFT_FUSED_TOKENS_MAX": "99"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["99", "True", "False"]
    env = {k: v for k, v in os.environ.items() if k != "THINKCRAFT_FUSED_TOKENS_MAX"}
    code = "from thinkcraft.llm.hf import triton_device as t; print(t.FUSED_TOKENS_MAX, t.fused_size(10 ** 6))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "True"]  # the default: every size


def test_prefill_graph_tokens_override(monkeypatch):
    import torch

    def make():  # CPU stand-ins for the capture and its gate: only the bound is read here
        return PrefillGraphs(lambda *a: None, torch.device("cpu"), 0, 8, capture=lambda *a: None, gate=object())

    monkeypatch.delenv("THINKCRAFT_PREFILL_GRAPH_TOKENS", raising=False)
    assert make().max_tokens == MAX_TOKENS
    monkeypatch.setenv("THINKCRAFT_PREFILL_GRAPH_TOKENS", "32768")
    assert make().max_tokens == 32768
    monkeypatch.setenv("THINKCRAFT_PREFILL_GRAPH_TOKENS", "0")
    with pytest.raises(UserError, match="THINKCRAFT_PREFILL_GRAPH_TOKENS must be a whole number >= 1"):
        make()
