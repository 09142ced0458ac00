"""utils/fallback.py: a fast path that fails falls back to its eager twin for good, warning once."""

from __future__ import annotations

import logging

from thinkcraft.utils.fallback import OrEager, compiled_or_eager


def test_a_fast_path_falls_back_once_and_for_good(caplog) -> None:
    calls, cleared = [], []

    def fast(x):
        calls.append(x)
        if x > 1:
            raise RuntimeError("capture failed")
        return ("fast", x)

    f = OrEager(fast, lambda x: ("eager", x), "compiled thing", logging.getLogger("t"), on_failure=lambda: cleared.append(1))
    with caplog.at_level(logging.WARNING):
        assert f(1) == ("fast", 1)
        assert f(2) == ("eager", 2)  # the failing call itself is answered eagerly
        assert f(0) == ("eager", 0)  # and every later one: the fast path is not tried again
    assert calls == [1, 2] and cleared == [1] and f.failed
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["compiled thing unavailable (RuntimeError: capture failed); running eager"]


def test_compiled_or_eager_runs_the_function(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (lambda *a: (_ for _ in ()).throw(RuntimeError("no compiler"))))
    f = compiled_or_eager(lambda x: x + 1, "add", logging.getLogger("t"))
    assert f(1) == 2
