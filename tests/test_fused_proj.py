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


@pytest.mark.parametrize("kind", ["plain", "lora", "lora-unfolded", "lora-merged"])
def test_fused_groups_equal_the_separate_projections(kind: str, monkeypatch) -> None:
    """Every layer's q/k/v and gate/up fused (two groups a layer, five projections), and with LoRA's A folded into
    the base GEMM (the default) o_proj and down_proj as groups of one; the logits equal those of the same layers
    computed one by one (the groups stripped) to bf16 rounding of the GEMMs."""
    monkeypatch.setenv("THINKCRAFT_LORA_MERGE", "1" if kind == "lora-merged" else "0")
    monkeypatch.setenv("THINKCRAFT_FOLD_LORA_A", "0" if kind == "lora-unfolded" else "1")
    model, _ = _model(kind != "plain")
    lora_fast.install(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    want = _logits(model, ids)
    groups = fused_proj.install(model)
    n = model.config.num_hidden_layers
    lora, folded = kind.startswith("lora") and kind != "lora-merged", kind == "lora"
    assert fused_proj.counts(groups) == {"groups": (4 if folded else 2) * n, "members": (7 if folded else 5) * n,
                                         "lora": (4 if folded else 2) * n if lora else 0,
                                         "folded": 4 * n if folded else 0, "singles": 2 * n if folded else 0}
    assert fused_proj.install(model) == groups  # idempotent
    calls = _counting(monkeypatch)
    got = _logits(model, ids)
    assert sorted(set(calls)) == ([1, 2, 3] if folded else [2, 3])  # one GEMM group per sibling set (and single)
    assert len(calls) == len(groups)
    assert all(g.stash is None for g in groups)  # the last sibling let go of the forward's outputs
    torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)


def _aten_ops(fn) -> list[str]:  # noqa: ANN001
    """The aten operators `fn()` dispatches (what a captured graph would hold as kernels, on the CPU's side)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return ops


@pytest.mark.parametrize("fold", ["1", "0"])
def test_folded_adapters_are_two_products_and_equal_unfolded(fold: str, monkeypatch) -> None:
    """A LoRA group with A folded computes the base outputs and `x Aᵀ` in ONE product and adds the low-rank part in
    place (two products, no copy); unfolded it is three products (base, A, addmm). Both give the members' own
    outputs (each projection alone: its lora_fast forward, no group) to bf16 rounding, q/k/v and o_proj."""
    monkeypatch.setenv("THINKCRAFT_FOLD_LORA_A", fold)
    model, _ = _model(lora=True, seed=5)
    lora_fast.install(model)
    groups = fused_proj.install(model)
    attn = model.base_model.model.model.layers[1].self_attn
    x = torch.randn(2, 5, model.config.hidden_size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(6))
    alone = {}
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            m = getattr(attn, name)
            g = m.__dict__.pop("_tc_group", None)
            alone[name] = m(x if name != "o_proj" else x[..., : m.in_features])
            if g is not None:
                m._tc_group = g
        group = attn.q_proj._tc_group
        assert group.fold == (fold == "1") and (attn.o_proj.__dict__.get("_tc_group") is not None) == (fold == "1")
        ops = _aten_ops(lambda: group.compute(x))
        prods = [o for o in ops if o in ("mm", "addmm", "addmm_", "bmm", "matmul", "linear")]
        assert prods == (["mm", "addmm_"] if fold == "1" else ["mm", "mm", "addmm"]), ops  # (no bias: mm)
        assert not [o for o in ops if o in ("copy_", "clone", "cat")], ops
        got = {n: getattr(attn, n)(x) for n in ("q_proj", "k_proj", "v_proj")}
        got["o_proj"] = attn.o_proj(x[..., : attn.o_proj.in_features])
    for name, want in alone.items():
        torch.testing.assert_close(got[name], want, atol=0.02 * want.abs().max().item(), rtol=0)
    assert len(groups) == (4 if fold == "1" else 2) * model.config.num_hidden_layers
    monkeypatch.setenv("THINKCRAFT_FOLD_LORA_A", "0" if fold == "1" else "1")  # the switch flipped, installed again
    again = fused_proj.install(model)
    assert len(again) == (2 if fold == "1" else 4) * model.config.num_hidden_layers
    assert (attn.o_proj.__dict__.get("_tc_group") is not None) == (fold != "1")  # the old single let go
    assert attn.q_proj._tc_group.fold == (fold != "1")


@pytest.mark.parametrize("fold", ["1", "0"])
def test_compiled_low_rank_add_is_in_place_and_equal(fold: str, monkeypatch) -> None:
    """Compiled (the decode step's forward), a LoRA group adds its low-rank part through the mutating op, which
    inductor re-inplaces over the GEMM's output: no out-of-place `addmm` (whose strided `self` was copied first, the
    decode step's bf16 copies), and the same values as the eager group (one rounding either way)."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("THINKCRAFT_FOLD_LORA_A", fold)
    model, _ = _model(lora=True, seed=5)
    lora_fast.install(model)
    fused_proj.install(model)
    attn = model.base_model.model.model.layers[1].self_attn
    group = attn.q_proj._tc_group
    assert group.fold == (fold == "1")
    x = torch.randn(2, 5, model.config.hidden_size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    with torch.no_grad():
        want = group.compute(x)
        got, (code, *_) = run_and_get_code(torch.compile(group.compute, fullgraph=True), x)
    assert torch.equal(got, want)
    assert "thinkcraft.lowrank_add_" in code and "extern_kernels.addmm" not in code, code
    assert "slice_scatter" not in code and "clone" not in code, code


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
    switches are validated; an engine over a bf16 LoRA model samples the same greedy tokens without them, with them
    and with the adapters' A folded (the default) over growing episodes that share a prefix, and says how many
    groups it runs and how many are folded."""
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
    monkeypatch.setenv("THINKCRAFT_FUSED_PROJ", "1")
    monkeypatch.setenv("THINKCRAFT_FOLD_LORA_A", "2")
    with pytest.raises(UserError, match="THINKCRAFT_FOLD_LORA_A"):
        fused_proj.install(model)
    lora, tok = _model(lora=True, seed=4)
    n = lora.config.num_hidden_layers
    runs = {}
    for flag, fold, groups, folded in (("0", "1", 0, 0), ("1", "0", 2 * n, 0), ("1", "1", 4 * n, 4 * n)):
        monkeypatch.setenv("THINKCRAFT_FUSED_PROJ", flag)
        monkeypatch.setenv("THINKCRAFT_FOLD_LORA_A", fold)
        m = copy.deepcopy(lora)
        strip_copies(m)  # a copy another engine served: it installs its own
        eng = HFEngine.from_model(m, tok, max_slots=4)
        runs[flag + fold] = _episodes(eng, tok)
        got = eng.decode_metrics()
        assert (got["fused_proj_groups"], got["fused_proj_folded"]) == (groups, folded)
    for run in ("10", "11"):
        for (k, e, tw, lw), (_, _, tg, lg) in zip(runs["01"], runs[run]):
            assert tg == tw, (run, k, e)
            np.testing.assert_allclose(lg, lw, atol=2e-2)
