"""Helpers shared by the LLM tests (imported as `from llm_helpers import ...`; tests/ is on the path)."""

from __future__ import annotations

import numpy as np
import torch


def forward_logprobs(model, prompt: list[int], tokens: list[int]) -> np.ndarray:  # noqa: ANN001
    """The log-probs a plain forward pass gives `tokens` after `prompt`: the reference for engine logprobs."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return lp[pos, torch.tensor(tokens)].numpy()


def spread_weights(model):  # noqa: ANN001, ANN201
    """A larger-than-default init, so log-probs are far from uniform (learner tests compare gradients)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model


def spread_lora_b(model):  # noqa: ANN001, ANN201
    """LoRA's B starts at 0 (then A gets no gradient): give it a value."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    return model


class NoGate:
    """A `CaptureGate` stand-in for the CPU (no other engine to hold back)."""

    def shared(self):  # noqa: ANN201
        import contextlib

        return contextlib.nullcontext()

    exclusive = shared


def replay_capture(run, device, pool=None):  # noqa: ANN001, ANN202
    """A graph capture's stand-in on the CPU: `replay()` runs the captured function again into the same output
    tensor, reading the same input buffers - what a CUDA graph's replay does."""
    out = run()
    return (lambda: out.copy_(run())), out


def check_env_switch(monkeypatch, var: str, read, default: bool, bad: str = "maybe") -> None:  # noqa: ANN001
    """`read()` follows the environment switch `var` (`utils.errors.env_switch`): unset `default`, "0" off, "1" on,
    `bad` one UserError naming the switch; unset again after."""
    import pytest

    from thinkcraft.utils.errors import UserError

    monkeypatch.delenv(var, raising=False)
    assert read() is default
    for value, want in (("0", False), ("1", True)):
        monkeypatch.setenv(var, value)
        assert read() is want
    monkeypatch.setenv(var, bad)
    with pytest.raises(UserError, match=f"{var} must be 0 or 1"):
        read()
    monkeypatch.delenv(var)
