"""Sibling projections fused into one GEMM (llm/hf/fused_proj.py): q/k/v and gate/up of every layer give the separate
projections' outputs (plain bf16 linears, LoRA layers with stacked adapters, merged LoRA weights), follow in-place
updates, step aside where they do not apply (gradients, adapters off, another input), pickle and strip; an engine
with them generates the same tokens."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from thinkcraft.llm.hf import HFEngine, fused_proj, lora_fast
from thinkcraft.llm.hf.weights import strip_copies
from thinkcraft.llm.testing import tiny_llama
from thinkcraft.utils.errors import UserError

from test_flash_decode import _episodes

peft = pytest.importorskip("peft")
from test_lora_fast import _logits, _lora  # noqa: E402 - after the skip: it needs PEFT too


def _model(lora: bool, seed: int = 0):  # noqa: ANN202
    """A bf16 tiny Llama, with LoRA on every linear (B non-zero) or plain."""
    if lora:
        return _lora(seed=seed)
    model, tok = tiny_llama(seed=seed)
    return model.to(torch.bfloat16), tok


def _counting(monkeypatch) -> list:  # noqa: ANN001
    calls: list = []
    real = fused_proj.Group.compute
    monkeypatch.setattr(fused_proj.Group, "compute", lambda self, x: calls.append(len(self.members)) or real(self, x))
    return calls


@pytest.mark.parametrize("kind", ["plain", "lora", "lora-merged"])
def test_fused_groups_equal_the_separate_projections(kind: str, monkeypatch) -> None:
    """Every layer's q/k/v and gate/up fused (two groups a layer, five projections); the logits equal those of the
    same layers computed one by one (the groups stripped) to bf16 rounding of the GEMMs."""
    monkeypatch.setenv("THINKCRAFT_LORA_MERGE", "1" if kind == "lora-merged" else "0")
    model, _ = _model(kind != "plain")
    lora_fast.install(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    want = _logits(model, ids)
    groups = fused_proj.install(model)
    n_layers = model.config.num_hidden_layers
    assert fused_proj.counts(groups) == {"groups": 2 * n_layers, "members": 5 * n_layers,
                                         "lora": 2 * n_layers if kind == "lora" else 0}
    assert fused_proj.install(model) == groups  # idempotent
    calls = _counting(monkeypatch)
    got = _logits(model, ids)
    assert sorted(set(calls)) == [2, 3] and len(calls) == 2 * n_layers  # one GEMM group per sibling set
    assert all(g.stash is None for g in groups)  # the last sibling let go of the forward's outputs
    torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)


def test_fused_groups_follow_updates_and_step_aside(monkeypatch) -> None:
    """An optimizer-style in-place adapter update reaches the fused copies (eagerly at the next forward; by
    `refresh` for graphed steps); gradients, adapters switched off and a sibling called with another input take
    the separate projections."""
    model, _ = _model(lora=True, seed=1)
    lora_fast.install(model)
    groups = fused_proj.install(model)
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))
    before = _logits(model, ids)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n:
                p.add_(0.2)
    after = _logits(model, ids)
    assert not torch.allclose(after, before)
    unfused = copy.deepcopy(model)
    fused_proj.strip(unfused)
    assert not fused_proj.counts(fused_proj.install(unfused, max_bytes=0))["groups"]  # no room: none made
    ref = _logits(unfused, ids)
    torch.testing.assert_close(after, ref, atol=0.02 * ref.abs().max().item(), rtol=0)
    assert fused_proj.refresh(groups) == 0  # the eager forward copied already
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).mul_(2)
    lora_fast.refresh(lora_fast.install(model))
    assert fused_proj.refresh(groups) == 1  # the graphed step's path: adapters' copies, then the group's
    assert fused_proj.refresh(groups) == 0
    calls = _counting(monkeypatch)
    with model.disable_adapter():
        _logits(model, ids)
    model(ids).logits.sum().backward()  # the learner's gradient path
    attn = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(1, 3, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        attn.q_proj(x)
        other = x.clone()
        k_other = attn.k_proj(other)  # not the leader's input: its own output
        group = attn.k_proj.__dict__.pop("_tc_group")
        k_alone = attn.k_proj(other)
        attn.k_proj._tc_group = group
    assert torch.equal(k_other, k_alone)
    assert calls == [3]  # only the leader's direct call above took the group
    assert attn.q_proj._tc_group.stash is not None and attn.q_proj._tc_group.stash[0] is x  # v_proj never came


def test_pickle_strip_switch_and_engine_tokens(monkeypatch) -> None:
    """A model with groups pickles whole (the swapped classes resolve by name); `strip` takes them out; the
    switch is validated; an engine over a bf16 LoRA model samples the same greedy tokens with and without them over
    growing episodes that share a prefix, and says how many groups it runs."""
    model, tok = _model(lora=False, seed=3)
    assert fused_proj.install(model)
    again = pickle.loads(pickle.dumps(model))
    assert type(again.model.layers[0].self_attn.q_proj).__name__.startswith("FusedProj")
    fused_proj.strip(model)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert "_tc_group" not in model.model.layers[0].mlp.up_proj.__dict__
    monkeypatch.setenv("THINKCRAFT_FUSED_PROJ", "maybe")
    with pytest.raises(UserError, match="THINKCRAFT_FUSED_PROJ"):
        fused_proj.install(model)
    lora, tok = _model(lora=True, seed=4)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("THINKCRAFT_FUSED_PROJ", flag)
        m = copy.deepcopy(lora)
        strip_copies(m)  # a copy another engine served: it installs its own
        eng = HFEngine.from_model(m, tok, max_slots=4)
        runs[flag] = _episodes(eng, tok)
        assert eng.decode_metrics()["fused_proj_groups"] == (2 * lora.config.num_hidden_layers if flag == "1" else 0)
    for (k, e, tw, lw), (_, _, tg, lg) in zip(runs["0"], runs["1"]):
        assert tg == tw, (k, e)
        np.testing.assert_allclose(lg, lw, atol=2e-2)
