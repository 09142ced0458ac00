"""llm/hf/fused_norm.py: HF's RMSNorm swapped for `F.rms_norm` gives HF's values and gradients within bf16
rounding on a bf16 model (fp32: within fp32 rounding), steps aside where the dtypes differ, follows the switch, and
undoes cleanly."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from thinkcraft.llm.hf import fused_norm
from thinkcraft.llm.testing import tiny_llama


def _run(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    emb = model.get_input_embeddings()
    x = emb(ids).detach().requires_grad_(True)
    out = model(inputs_embeds=x).logits.float()
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), x.grad.float()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: the q/k norms inside attention too
def test_fused_norm_equals_hf_within_rounding(arch: str) -> None:
    model, _ = tiny_llama(arch=arch, seed=3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # away from 1: the weight's product is where the two forwards round differently
                p.normal_(1.0, 0.3)
    model = model.to(torch.bfloat16)
    twin = copy.deepcopy(model)
    n_norms = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
    assert fused_norm.install(model) == n_norms > 0 and fused_norm.installed(model) == n_norms
    assert fused_norm.install(model) == n_norms  # idempotent
    assert type(pickle.loads(pickle.dumps(model)).model.norm) is type(model.model.norm)  # found by name
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    out, gx = _run(model, ids)
    ref, ref_gx = _run(twin, ids)
    torch.testing.assert_close(out, ref, atol=0.03 * ref.abs().max().item(), rtol=0)
    torch.testing.assert_close(gx, ref_gx, atol=0.05 * ref_gx.abs().max().item(), rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # inside autocast too
        torch.testing.assert_close(_run(model, ids)[0], ref, atol=0.03 * ref.abs().max().item(), rtol=0)
    fused_norm.strip(model)
    assert fused_norm.installed(model) == 0
    assert torch.equal(_run(model, ids)[0], ref)  # HF's forward back, bit for bit


def test_fp32_fuses_mixed_dtypes_keep_hf_and_the_switch(monkeypatch) -> None:
    model, _ = tiny_llama(seed=4)  # fp32: full fine-tuning's master weights and residual stream
    twin = copy.deepcopy(model)
    assert fused_norm.install(model) > 0
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = twin(ids).logits
        torch.testing.assert_close(model(ids).logits, ref, atol=1e-5 * ref.abs().max().item(), rtol=0)
        x = model.get_input_embeddings()(ids).to(torch.bfloat16)  # bf16 activations on fp32 weights: HF's forward
        y = model.model.norm(x)
        assert y.dtype == torch.float32 and torch.equal(y, twin.model.norm(x))
    monkeypatch.setenv("THINKCRAFT_FUSED_RMSNORM", "0")
    off, _ = tiny_llama(seed=4)
    assert fused_norm.install(off) == 0 and fused_norm.installed(off) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused CUDA kernel and CUDA autocast need a GPU (none here)")
def test_fused_norm_on_gpu_keeps_bf16_under_autocast_and_matches_hf() -> None:
    from thinkcraft.llm import compat

    model, _ = tiny_llama(arch="qwen3", seed=5)
    model = model.to("cuda", torch.bfloat16)
    twin = copy.deepcopy(model)
    fused_norm.install(model)
    norm = model.model.norm
    x = torch.randn(4096, norm.weight.shape[0], device="cuda", dtype=torch.bfloat16)
    with compat.autocast(torch.bfloat16):  # CUDA autocast runs rms_norm in fp32: the swap must not
        y = norm(x)
        assert y.dtype == torch.bfloat16
        ids = torch.randint(0, 64, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        out, ref = model(ids).logits.float(), twin(ids).logits.float()
    torch.testing.assert_close(y, twin.model.norm(x), atol=0.04 * x.abs().max().item(), rtol=0)
    torch.testing.assert_close(out, ref, atol=0.03 * ref.abs().max().item(), rtol=0)


def test_a_model_with_fused_norms_unpickles_in_a_fresh_process(tmp_path) -> None:
    import subprocess
    import sys

    model, _ = tiny_llama(seed=6)
    fused_norm.install(model)
    torch.save(model, tmp_path / "m.pt")  # as Ray's object store ships a model to an actor: whole, by class name
    ids = torch.arange(5)[None]
    with torch.no_grad():
        (tmp_path / "ref.txt").write_text(repr(model(ids).logits.sum().item()))
    code = ("import torch; m = torch.load(r'%s', weights_only=False); "
            "from thinkcraft.llm.hf import fused_norm; assert fused_norm.installed(m) > 0; "
            "print(repr(m(torch.arange(5)[None]).logits.sum().item()))" % (tmp_path / "m.pt"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip()) == pytest.approx(float((tmp_path / "ref.txt").read_text()), rel=1e-6)
    from thinkcraft.llm.hf import lora_fast

    with pytest.raises(AttributeError):  # other names stay missing, as a module's must
        lora_fast.Fast__no__such__module__Cls  # noqa: B018
