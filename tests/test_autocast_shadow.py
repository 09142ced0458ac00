"""Half shadows of fp32 master weights (llm/hf/autocast_shadow.py): an engine sharing full fine-tuning's fp32
weights under bf16 autocast generates what it generated with autocast's per-step casts, follows the learner's
in-place updates, leaves the learner's gradient path and any forward without that autocast untouched, and a
copy made for a copy engine (`weights.autocast_weights`) carries no shadows."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from thinkcraft.llm import compat
from thinkcraft.llm.hf import HFEngine, autocast_shadow
from thinkcraft.llm.hf.weights import autocast_weights
from thinkcraft.llm.protocol import Batch, SamplingParams
from thinkcraft.llm.testing import tiny_llama
from thinkcraft.utils.errors import UserError

SP = SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=True)


@pytest.fixture(scope="module")
def tiny() -> tuple:
    model, tok = tiny_llama()
    return model.float(), tok


def _generate(model, tok, prompts) -> list:  # noqa: ANN001
    with compat.autocast(torch.bfloat16, "cpu"):
        eng = HFEngine.from_model(model, tok)
        out = eng.generate(Batch(items=prompts), SP)
    return out, eng


def _prompts(tok) -> list[list[int]]:  # noqa: ANN001
    return [list(tok(t, add_special_tokens=False)["input_ids"]) for t in ("Hello there", "The quick brown fox")]


def test_a_shared_fp32_engine_under_autocast_generates_the_cast_weights_tokens(tiny, monkeypatch) -> None:
    model, tok = tiny
    prompts = _prompts(tok)
    monkeypatch.setenv("THINKCRAFT_AUTOCAST_SHADOW", "0")
    want, eng0 = _generate(copy.deepcopy(model), tok, prompts)
    assert not eng0._shadow
    monkeypatch.delenv("THINKCRAFT_AUTOCAST_SHADOW")
    learner = copy.deepcopy(model)
    got, eng = _generate(learner, tok, prompts)
    linears = [m for m in learner.modules() if isinstance(m, torch.nn.Linear)]
    assert len(eng._shadow) == len(linears) > 0 and all(m._tc_w.dtype == torch.bfloat16 for m in linears)
    assert all(p.dtype == torch.float32 for p in learner.parameters())  # the learner's weights stay fp32
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)

    # the engine really reads the shadows: the LM head's zeroed behind the check's back gives uniform logits
    head = compat.lm_head(learner)
    with torch.no_grad():
        head._tc_w.zero_()
        with compat.autocast(torch.bfloat16, "cpu"):
            flat = eng.generate(Batch(items=prompts[:1]), SP)[0]
        np.testing.assert_allclose(flat.logprobs, -np.log(head.weight.shape[0]), atol=1e-3)
        head.weight.add_(0.0)  # a version bump: the next step copies the weight again
    x = torch.randint(0, 64, (2, 6))
    with compat.autocast(torch.bfloat16, "cpu"):
        loss = learner(x).logits.float().logsumexp(-1).mean()
    loss.backward()
    assert all(m.weight.grad is not None for m in linears)  # the gradient path is nn.Linear's own
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference = copy.deepcopy(learner)
    autocast_shadow.strip(reference)
    monkeypatch.setenv("THINKCRAFT_AUTOCAST_SHADOW", "0")
    want2, _ = _generate(reference, tok, prompts)
    with compat.autocast(torch.bfloat16, "cpu"):
        got2 = eng.generate(Batch(items=prompts), SP)
    assert [c.token_ids for c in got2] == [c.token_ids for c in want2]
    assert [c.token_ids for c in got2] != [c.token_ids for c in got]  # the update changed what it generates
    for a, b in zip(want2, got2):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)

    # outside bf16 autocast a no-grad forward is the fp32 one
    with torch.no_grad():
        torch.testing.assert_close(learner(x).logits, reference(x).logits, rtol=0, atol=0)


def test_the_learner_reads_a_shadowed_head_as_its_plain_linear(tiny) -> None:
    """The engine shares the learner's modules, so the learner meets the shadow classes too: its LM head
    (`compat.plain_lm_head`, read by weight, not called) is still the plain linear map, its fp32 master tensors
    (2 x H200, 2026-11-29: every full fine-tuning update on a GPU stopped at "not a plain Linear"); an adapter
    subclass is still refused."""
    model, tok = tiny
    learner = copy.deepcopy(model)
    _generate(learner, tok, _prompts(tok))
    head = compat.lm_head(learner)
    assert isinstance(head, autocast_shadow._ShadowLinearMixin)
    weight, bias = compat.plain_lm_head(learner)
    assert weight is head.weight and bias is head.bias and weight.dtype == torch.float32

    class Adapted(torch.nn.Linear):
        def forward(self, x):  # noqa: ANN001, ANN202
            return super().forward(x) + 1

    adapted = copy.deepcopy(model)
    old = compat.lm_head(adapted)
    new = Adapted(old.in_features, old.out_features, bias=old.bias is not None)
    adapted.set_output_embeddings(new)
    autocast_shadow.install(adapted, torch.bfloat16)  # not plain: not shadowed, and still refused
    with pytest.raises(UserError, match="not a plain Linear"):
        compat.plain_lm_head(adapted)


def test_a_copy_for_a_copy_engine_carries_no_shadows(tiny) -> None:
    model, tok = tiny
    learner = copy.deepcopy(model)
    _generate(learner, tok, _prompts(tok))  # the shared engine installed its shadows on the learner's modules
    twin = autocast_weights(copy.deepcopy(learner), torch.bfloat16)
    assert not any(hasattr(m, "_tc_w") or "Shadow" in type(m).__name__ for m in twin.modules())
    assert {m.weight.dtype for m in twin.modules() if isinstance(m, torch.nn.Linear)} == {torch.bfloat16}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the graphed decode step needs a GPU (none here)")
def test_graphed_decode_reads_the_refreshed_shadows_on_gpu(monkeypatch) -> None:
    """On a GPU, compiled and hand-captured: the shared fp32 engine under bf16 autocast generates what the same
    engine without shadows generates, before and after an in-place update of the weights (the captured graph
    reads the shadows, refreshed in place before each step)."""
    model, tok = tiny_llama()
    model = model.float().cuda()
    prompts = _prompts(tok)

    def run(m, shadow: bool, eng=None):  # noqa: ANN001, ANN202
        monkeypatch.setenv("THINKCRAFT_AUTOCAST_SHADOW", "1" if shadow else "0")
        eng = eng or HFEngine.from_model(m, tok, compile_decode=True)
        with compat.autocast(torch.bfloat16, "cuda"):
            return eng.generate(Batch(items=prompts), SP), eng

    def agree(a, b) -> None:  # noqa: ANN001
        assert np.mean([x.token_ids == y.token_ids for x, y in zip(a, b)]) >= 0.5  # bf16 near-ties may flip
        n = next((i for i, (p, q) in enumerate(zip(a[0].token_ids, b[0].token_ids)) if p != q), len(a[0].token_ids))
        np.testing.assert_allclose(a[0].logprobs[:n], b[0].logprobs[:n], atol=2e-2)

    learner = copy.deepcopy(model)
    got, eng = run(learner, True)
    assert eng._shadow and not eng._batcher._step_fn.failed
    want, _ = run(copy.deepcopy(model), False)
    agree(want, got)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.05 * torch.randn_like(p))
    got2, _ = run(learner, True, eng)
    reference = copy.deepcopy(learner)
    autocast_shadow.strip(reference)
    want2, _ = run(reference, False)
    agree(want2, got2)
    assert [c.token_ids for c in got2] != [c.token_ids for c in got]


def test_shadows_over_the_memory_allowed_are_not_made(tiny) -> None:
    model, _ = tiny
    m = copy.deepcopy(model)
    need = 2 * sum(x.weight.numel() + (x.bias.numel() if x.bias is not None else 0) for x in autocast_shadow.shadowable(m))
    assert not autocast_shadow.install(m, torch.bfloat16, max_bytes=need - 1)
    assert not any(hasattr(x, "_tc_w") for x in m.modules())
    assert len(autocast_shadow.install(m, torch.bfloat16, max_bytes=need)) == len(autocast_shadow.shadowable(m))
    assert not autocast_shadow.install(m, torch.float32)  # nothing to save: fp32 autocast casts nothing
