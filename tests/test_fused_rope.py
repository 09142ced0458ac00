"""q's and k's rotary embedding as one kernel each (llm/hf/fused_rope.py): its Triton kernel runs on the CPU under
Triton's interpreter in a fresh process (TRITON_INTERPRET is read when Triton loads), equal to HF's
`apply_rotary_pos_emb` bit for bit (values and strides) on strided views, odd head counts, a broadcast cos, fp16,
and inside tiny bf16 models' no-grad forwards (Llama; Qwen3's q/k norms; LoRA with the fused projections), where every
layer takes it; the first-use check refuses a wrong kernel; elsewhere (no interpreter, gradients, another
`unsqueeze_dim`, the switch off) HF's function runs, and `strip` puts it back."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from thinkcraft.llm.hf import fused_rope, triton_device
from thinkcraft.llm.testing import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
peft = pytest.importorskip("peft")

SCRIPT = r"""
import torch
from transformers.models.llama import modeling_llama
from thinkcraft.llm.hf import fused_proj, fused_rope, lora_fast
from thinkcraft.llm.testing import tiny_llama
from test_lora_fast import _logits, _lora

cpu = torch.device("cpu")
assert fused_rope.serves(cpu, torch.bfloat16) and fused_rope.serves(cpu, torch.float16), "first-use check failed"
hf = modeling_llama.apply_rotary_pos_emb
gen = torch.Generator().manual_seed(3)
for B, T, H, Hk, D, dtype, cos_b in ((1, 1, 1, 1, 2, torch.bfloat16, 1), (1, 50, 14, 2, 64, torch.bfloat16, 1),
                                     (2, 9, 3, 3, 128, torch.float16, 2), (3, 5, 4, 2, 16, torch.bfloat16, 1)):
    y = (4 * torch.randn(B, T, (H + 2 * Hk) * D + 8, generator=gen)).to(dtype)
    q = y[..., : H * D].view(B, T, H, D).transpose(1, 2)
    k = y[..., H * D: (H + Hk) * D].view(B, T, Hk, D).transpose(1, 2)
    ang = torch.randn(cos_b, T, D // 2, generator=gen) * 5
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want = hf(q, k, cos, sin)
    for x, w in zip(want, (fused_rope.rope_one(q, cos, sin), fused_rope.rope_one(k, cos, sin))):
        assert torch.equal(x, w) and x.stride() == w.stride(), (B, T, H, D, x.stride(), w.stride())
    qc = q.contiguous()  # a contiguous (B, H, T, D) input keeps its layout too
    assert fused_rope.rope_one(qc, cos, sin).stride() == hf(qc, qc, cos, sin)[0].stride()

ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
for arch in ("llama", "qwen3"):
    model, _ = tiny_llama(arch=arch)
    model = model.to(torch.bfloat16)
    want = _logits(model, ids)
    assert fused_rope.install(model) == 1
    before = fused_rope.calls
    got = _logits(model, ids)
    assert fused_rope.calls - before == model.config.num_hidden_layers, fused_rope.calls - before
    assert torch.equal(got, want), arch  # HF's values bit for bit
    fused_rope.strip(model)
model, _ = _lora()  # LoRA, its A folded into the q/k/v GEMM: q and k are column slices of that GEMM's output
lora_fast.install(model)
fused_proj.install(model)
want = _logits(model, ids)
fused_rope.install(model)
before = fused_rope.calls
got = _logits(model, ids)
assert fused_rope.calls - before == model.config.num_hidden_layers and torch.equal(got, want)
print("ok")
"""


def test_kernel_and_models_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (torch's CPU wheel may come without it)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}
    env.pop("THINKCRAFT_FUSED_ROPE", None)  # the default: on
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout[-2000:], out.stderr[-4000:])


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, flip: bool = False) -> torch.Tensor:
    """The kernel's contract in torch's ops (a stand-in where Triton cannot run), or with the rotation's sign
    flipped (a wrong kernel)."""
    from transformers.models.qwen2.modeling_qwen2 import rotate_half

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    r = rotate_half(x)
    return x * c + (-r if flip else r) * s


def test_the_first_use_check_refuses_a_wrong_kernel(monkeypatch, caplog) -> None:
    """The check compares with HF's function: the contract written in torch's ops passes it, the same with the
    rotation's sign flipped fails it with one warning (the attention then keeps HF's ops)."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(fused_rope, "rope_one", _torch_rope)
    assert fused_rope._CHECKS.run(cpu, torch.bfloat16)
    monkeypatch.setattr(fused_rope, "rope_one", lambda x, c, s: _torch_rope(x, c, s, flip=True))
    with caplog.at_level(logging.WARNING, logger="thinkcraft.llm.hf.fused_rope"):
        assert not fused_rope._CHECKS.run(cpu, torch.bfloat16)
    assert "failed its first-use check" in caplog.text and "differs from HF's" in caplog.text


def test_steps_aside_where_it_does_not_serve(monkeypatch) -> None:
    """Without the interpreter on the CPU, over more tokens than FUSED_TOKENS_MAX allows, with gradients,
    with another unsqueeze_dim, or with the switch off, HF's
    function runs (the kernel is never called) and the logits are HF's; strip puts HF's function back."""
    from transformers.models.llama import modeling_llama

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("THINKCRAFT_FUSED_ROPE", raising=False)
    hf = modeling_llama.apply_rotary_pos_emb
    model, _ = tiny_llama()
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    try:
        assert fused_rope.install(model) == 1 and fused_rope.install(model) == 1  # idempotent: wrapped once
        wrapped = modeling_llama.apply_rotary_pos_emb
        assert wrapped is not hf and getattr(wrapped, fused_rope._MARK) is hf
        called = []
        monkeypatch.setattr(fused_rope, "rope_one", lambda x, c, s: called.append(1) or _torch_rope(x, c, s))
        with torch.no_grad():
            assert torch.equal(model(ids).logits, want)  # no interpreter, no GPU: HF's ops
        assert not called
        monkeypatch.setattr(fused_rope, "serves", lambda device, dtype: True)  # as if on a GPU
        with torch.no_grad():
            assert torch.equal(model(ids).logits, want)  # the stand-in kernel: the same values
        assert len(called) == 2 * model.config.num_hidden_layers  # q and k, every layer
        called.clear()
        monkeypatch.setattr(triton_device, "FUSED_TOKENS_MAX", 17)  # the batch's 18 tokens: a prefill's size
        with torch.no_grad():
            assert torch.equal(model(ids).logits, want)
        assert not called
        monkeypatch.setattr(triton_device, "FUSED_TOKENS_MAX", 18)
        with torch.no_grad():
            model(ids)
        assert len(called) == 2 * model.config.num_hidden_layers  # at the bound: the kernel
        called.clear()
        with torch.enable_grad():  # the learner's path: HF's ops
            model(ids).logits.float().sum().backward()
        q = torch.randn(1, 2, 3, 4, dtype=torch.bfloat16)
        cos = torch.randn(1, 3, 4, dtype=torch.bfloat16)
        with torch.no_grad():
            wrapped(q.transpose(1, 2), q.transpose(1, 2), cos, cos, unsqueeze_dim=2)
            wrapped(q.float(), q.float(), cos.float(), cos.float())  # fp32: not a half dtype
        assert not called
        fused_rope.strip(model)
        assert modeling_llama.apply_rotary_pos_emb is hf
        monkeypatch.setenv("THINKCRAFT_FUSED_ROPE", "0")
        assert fused_rope.install(model) == 0 and modeling_llama.apply_rotary_pos_emb is hf
    finally:
        modeling_llama.apply_rotary_pos_emb = hf


@pytest.mark.gpu
def test_a_lora_models_forward_with_the_kernel_on_a_gpu() -> None:
    """On CUDA: the check passes, and a bf16 LoRA model's no-grad forward of 300 tokens through the kernel equals the
    one through HF's ops bit for bit."""
    from test_lora_fast import _logits, _lora_fused_on_cuda

    model, ids = _lora_fused_on_cuda()
    dev = ids.device
    assert fused_rope.serves(dev, torch.bfloat16)
    want = _logits(model, ids)
    try:
        fused_rope.install(model)
        before = fused_rope.calls
        got = _logits(model, ids)
        assert fused_rope.calls > before and fused_rope.passed(dev)
        assert torch.equal(got, want)
    finally:
        fused_rope.strip(model)
