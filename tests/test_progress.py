"""Progress lines: `–` for values not known yet, whole lines in a log file, smoothed rates."""

from __future__ import annotations

import math

import pytest

from thinkcraft.utils import progress as P


def test_unknown_values_print_as_a_dash_never_nan(capsys):
    with P.RunProgress(100, "PPO Craftax-Classic-Symbolic-v1") as p:
        p.update(100, sps=1234.5, ret=float("nan"), loss=float("inf"))
    err = capsys.readouterr().err
    assert "ret –" in err and "loss –" in err and "nan" not in err and "inf" not in err
    assert "sps 1,234" in err or "sps 1,235" in err
    assert P.fmt_value(float("nan")) == "–" and P.fmt_value(0.01234) == "0.0123" and P.fmt_value(12345.6) == "12,346"


def test_log_file_lines_are_not_wrapped(capsys):
    # not a terminal (pytest captures stderr): one line per update however long, as a log file gets it
    title = "PPO " + "Craftax-Classic-Symbolic-v1 " * 4
    with P.RunProgress(10, title, log_every_s=0.0) as p:
        p.update(5, sps=1000.0, ret=1.5, achievements=0.25, entropy=2.5, value_loss=0.1, policy_loss=0.01)
        p.update(10, sps=1000.0, ret=1.5)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("PPO Craftax") for line in lines)
    assert len(lines[0]) > 120
    P.console.print("x " * 100)  # the shared console (the `done: ...` summaries) does not wrap either
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_time_ema_weighs_values_by_the_time_they_cover():
    ema = P.TimeEma(tau_s=30.0, start=0.0)
    assert math.isnan(ema.value)
    assert ema.update(1000.0, now=10.0) == 1000.0  # the first value is shown as is
    # one slow second (a checkpoint) moves the average by ~3%, not to the slow value
    slow = ema.update(10.0, now=11.0)
    assert 850 < slow < 1000
    assert ema.update(float("nan"), now=12.0) == slow  # skipped
    for t in range(12, 200):  # a sustained change is followed within a few time constants
        v = ema.update(10.0, now=float(t))
    assert v == pytest.approx(10.0, abs=1.0)


def test_rates_are_smoothed_other_fields_are_not():
    now = iter([0.0, 0.0, 10.0, 11.0])
    p = P.RunProgress(100, "x", clock=lambda: next(now))
    p.__enter__()
    assert p.info(sps=1000.0, ret=5.0) == "sps 1,000  ret 5"
    shown = p.info(sps=10.0, ret=1.0)
    assert shown.startswith("sps 8") or shown.startswith("sps 9")  # ~894: smoothed
    assert shown.endswith("ret 1")  # a return is a chunk mean already: shown as is
    assert P.is_smoothed("items_per_s") and P.is_smoothed("samples_s") and P.is_smoothed("s_per_step")
    assert not P.is_smoothed("reward") and not P.is_smoothed("ret")
