"""triton_device.FirstUseChecks: the one memo of the kernels' first-use checks (the rotary and MLP kernels per
dtype, the split decode per dtype / head dim / group, the sampler's chosen noise variant per device)."""

import logging

import torch

from thinkcraft.llm.hf.triton_device import FirstUseChecks


def test_a_check_runs_once_per_key_keeps_its_value_and_a_failure_warns_once(caplog) -> None:
    calls = []

    def check(device, dtype, head_dim):  # noqa: ANN001, ANN202
        calls.append((device.type, dtype, head_dim))
        if head_dim == 80:
            raise RuntimeError("differs from the reference")
        return "four" if dtype == torch.float32 else None

    log = logging.getLogger("test_first_use_checks")
    checks = FirstUseChecks(check, log, "the test kernel", "the model keeps torch's ops",
                            lambda dtype, head_dim: f"{dtype}, head dim {head_dim}")
    cpu = torch.device("cpu")
    assert checks.known(cpu, torch.float32, 64) is None and not checks.checked(cpu, torch.float32, 64)
    assert not checks.passed(cpu)
    assert checks.value(cpu, torch.float32, 64) == "four" and checks.ok(cpu, torch.float32, 64)
    assert checks.known(cpu, torch.float32, 64) == "four" and checks.checked(cpu, torch.float32, 64)
    assert checks.value(cpu, torch.bfloat16, 64) is True  # a check returning None passed
    with caplog.at_level(logging.WARNING, logger="test_first_use_checks"):
        assert not checks.ok(cpu, torch.bfloat16, 80)
        assert not checks.ok(cpu, torch.bfloat16, 80)  # remembered: no second run, no second warning
    assert calls == [("cpu", torch.float32, 64), ("cpu", torch.bfloat16, 64), ("cpu", torch.bfloat16, 80)]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1
    assert "the test kernel failed its first-use check on cpu (torch.bfloat16, head dim 80)" in warned[0]
    assert "differs from the reference" in warned[0] and "the model keeps torch's ops" in warned[0]
    assert checks.passed(cpu) and not checks.passed(torch.device("meta"))
