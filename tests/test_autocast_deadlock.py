"""The autocast deadlock of two threads, one tracing with torch.compile (`thinkcraft.llm.compat.autocast` says
why): our autocast regions must let a compile on one thread finish while another thread enters and leaves
autocast. Each case runs in a subprocess with a time limit - a deadlocked process cannot be stopped from
inside (no Python frame moves)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from thinkcraft.llm import compat

SRC = str(Path(__file__).resolve().parents[1] / "src")

# thread A: compiles (Dynamo traces fp32 leaf parameters that require grad under bf16 autocast: an engine
# compiling its decode step over the learner's parameters); thread B: enters and leaves autocast in a loop (an
# engine's decode steps, the learner's micro-batches); `ours` picks compat.autocast or torch's default
SCRIPT = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {src!r})
    import torch
    from thinkcraft.llm import compat

    ours = sys.argv[1] == "ours"
    def region():
        return compat.autocast(torch.bfloat16, "cpu") if ours else torch.autocast("cpu", dtype=torch.bfloat16)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    x = torch.randn(4, 32)
    stop = threading.Event()

    def steps():
        while not stop.is_set():
            with region():
                model[0](x)

    t = threading.Thread(target=steps, daemon=True)
    t.start()
    for i in range(3):
        torch._dynamo.reset()
        with region():
            out = torch.compile(model, backend="eager")(x)
        assert out.dtype == torch.bfloat16, out.dtype
        print("compiled", i, flush=True)
    stop.set()
    t.join()  # a thread still inside torch at interpreter exit aborts the process
    print("done", flush=True)
""")


def _run(which: str, timeout_s: float) -> subprocess.CompletedProcess | None:
    """The script's result, or None when it was still running after `timeout_s` (killed)."""
    try:
        return subprocess.run([sys.executable, "-c", SCRIPT.format(src=SRC), which], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


def test_compat_autocast_has_no_cast_cache_and_casts():
    with compat.autocast(torch.bfloat16, "cpu"):
        assert torch.is_autocast_enabled("cpu")
        assert not torch.is_autocast_cache_enabled()
        w = torch.nn.Linear(8, 8)
        assert w(torch.randn(2, 8)).dtype == torch.bfloat16
    assert torch.is_autocast_cache_enabled()  # restored on exit


def test_compile_beside_autocast_regions_finishes():
    r = _run("ours", timeout_s=240)
    assert r is not None, "a torch.compile trace beside another thread's autocast regions deadlocked"
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done" in r.stdout and r.stdout.count("compiled") == 3


@pytest.mark.slow
def test_the_deadlock_is_real_with_torch_default_autocast():
    """The control: with torch's default (cast cache on) the same script hangs - so the test above can tell.
    Skipped, not failed, on a torch that fixed it (then compat.autocast's reason is gone: say so there)."""
    r = _run("torch", timeout_s=25)
    if r is not None:
        pytest.skip(f"torch {torch.__version__} did not deadlock with its cast cache (rc {r.returncode}): the control "
                    "cannot show the test's power here; compat.autocast's reason may be gone")
