"""The MLP's silu(gate) * up as one kernel over the fused gate/up output (llm/hf/fused_mlp.py): its Triton kernel runs
on the CPU under Triton's interpreter in a fresh process (TRITON_INTERPRET is read when Triton loads), equal to
torch's ops on strided bf16 halves (a step of bf16 at most, almost all equal) and inside a tiny LoRA model's no-grad
forward, where every MLP takes it (THINKCRAFT_FUSED_MLP, on by default); elsewhere (no interpreter, gradients, the switch off, no fused group) the MLP
keeps torch's ops, and the swap strips and pickles."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from thinkcraft.llm.hf import fused_mlp, fused_proj, lora_fast, triton_device
from thinkcraft.llm.testing import tiny_llama

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _switch_on(monkeypatch):  # noqa: ANN001, ANN202 - whatever the caller's environment says
    monkeypatch.setenv("THINKCRAFT_FUSED_MLP", "1")
peft = pytest.importorskip("peft")
from test_lora_fast import _logits, _lora, _lora_fused_on_cuda  # noqa: E402 - after the skip: it needs PEFT too

SCRIPT = r"""
import os
import torch
from thinkcraft.llm.hf import fused_mlp, fused_proj, lora_fast
from test_lora_fast import _logits, _lora

cpu = torch.device("cpu")
assert fused_mlp.serves(cpu, torch.bfloat16), "the first-use check failed under the interpreter"
assert fused_mlp.lora_serves(cpu, torch.bfloat16), "the LoRA kernel's first-use check failed under the interpreter"
gen = torch.Generator().manual_seed(3)
for rows, n, extra in ((1, 7, 0), (5, 1024, 8), (9, 1100, 40)):  # one block, exactly one, a part block + A's columns
    y = (3 * torch.randn(rows, 2 * n + extra, generator=gen)).to(torch.bfloat16)
    got, want = fused_mlp.silu_mul(y, n).float(), fused_mlp.reference(y, n).float()
    assert got.shape == (rows, n) and fused_mlp.silu_mul(y, n).is_contiguous()
    assert ((got - want).abs() <= want.abs().clamp_min(1e-3) * 2 ** -7 * 1.01).all(), (got - want).abs().max()
    assert (got == want).float().mean() >= 0.99
assert fused_mlp.silu_mul(torch.zeros(0, 6, dtype=torch.bfloat16), 3).shape == (0, 3)

model, _ = _lora()
lora_fast.install(model)
ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
groups = fused_proj.install(model)
want = _logits(model, ids)  # fused projections, torch's MLP ops
assert fused_mlp.install(model) == model.config.num_hidden_layers
calls, lora_calls = [], []
real, real_lora = fused_mlp.silu_mul, fused_mlp.lora_silu_mul
fused_mlp.silu_mul = lambda y, n: calls.append(tuple(y.shape)) or real(y, n)
fused_mlp.lora_silu_mul = lambda y, n, bt: lora_calls.append(tuple(y.shape)) or real_lora(y, n, bt)
got = _logits(model, ids)
assert not calls and len(lora_calls) == model.config.num_hidden_layers, (calls, lora_calls)
assert all(r == 18 for r, _ in lora_calls)  # the batch's 2 x 9 tokens, one call a layer, the low-rank add inside
torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)
os.environ["THINKCRAFT_FUSED_MLP_LORA"] = "0"  # the A/B switch: addmm_'s pass, then the plain kernel
lora_calls.clear()
off = _logits(model, ids)
assert len(calls) == model.config.num_hidden_layers and not lora_calls, (calls, lora_calls)
torch.testing.assert_close(got, off, atol=0.01 * off.abs().max().item(), rtol=0)
del os.environ["THINKCRAFT_FUSED_MLP_LORA"]

for rows, n, r in ((1, 7, 4), (20, 300, 32), (1100, 130, 16)):  # one row, rank 2 x 16, the 64-row tile
    bt = torch.zeros(r, 2 * n)
    bt[: r // 2, :n], bt[r // 2:, n:] = 0.3 * torch.randn(r // 2, n, generator=gen), 0.3 * torch.randn(r // 2, n, generator=gen)
    bt = bt.to(torch.bfloat16)
    y = (3 * torch.randn(rows, 2 * n + r, generator=gen)).to(torch.bfloat16)
    before = y.clone()
    got, want = real_lora(y, n, bt).float(), fused_mlp.lora_reference(y, n, bt).float()
    exact = fused_mlp.lora_exact(y, n, bt).float()
    assert (got == exact).float().mean() >= 0.98
    assert torch.equal(y, before)  # the GEMM's output is read, not written
    assert got.shape == (rows, n) and got.is_contiguous()
    assert ((got - want).abs() <= want.abs().clamp_min(1e-3) * 2 ** -6 * 1.01).all(), (got - want).abs().max()
    assert (got == want).float().mean() >= 0.98
    unadded = fused_mlp.reference(y, n).float()  # the kernel does add the low-rank part
    assert (got - unadded).abs().max() > 0.1

# a compiled forward (the decode step's) takes the kernel as one opaque op, and the switch keeps inductor's ops
mlp = next(m for m in model.modules() if isinstance(m, fused_mlp._FusedMLPMixin))
x = torch.randn(1, 5, model.config.hidden_size, generator=gen).to(torch.bfloat16)
with torch.no_grad():
    eager = mlp(x)
    for on in (True, False):
        os.environ["THINKCRAFT_FUSED_MLP_LORA_COMPILED"] = "1" if on else "0"
        torch._dynamo.reset()
        lora_calls.clear()
        comp = torch.compile(mlp.forward)(x)
        assert bool(lora_calls) == on, (on, lora_calls)
        torch.testing.assert_close(comp.float(), eager.float(), atol=0.02 * eager.abs().max().item(), rtol=0)
del os.environ["THINKCRAFT_FUSED_MLP_LORA_COMPILED"]
print("ok")
"""


def _interpreted(script: str) -> subprocess.CompletedProcess:
    """`script` in a fresh process under Triton's interpreter, the kernels' switches on (the caller's environment
    aside: THINKCRAFT_FUSED_MLP on, the LoRA switches at their defaults)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}
    env["THINKCRAFT_FUSED_MLP"] = "1"
    for k in ("THINKCRAFT_FUSED_MLP_LORA", "THINKCRAFT_FUSED_MLP_LORA_COMPILED"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)


def test_kernel_and_model_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (torch's CPU wheel may come without it)")
    out = _interpreted(SCRIPT)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout[-2000:], out.stderr[-4000:])


ENGINE_SCRIPT = r"""
import os
import torch
from thinkcraft.llm.hf import HFEngine, fused_mlp
from thinkcraft.llm.protocol import Batch, SamplingParams
from test_lora_fast import _lora

model, tok = _lora()
prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in ("Hello there", "The quick brown fox", "a b c")]
sp = SamplingParams(max_new_tokens=5, temperature=0.0, logprobs=True)
assert fused_mlp.lora_serves(torch.device("cpu"), torch.bfloat16)  # the first-use check, before counting
calls = []
real = fused_mlp.lora_silu_mul
fused_mlp.lora_silu_mul = lambda y, n, bt, **k: calls.append(y.shape[0]) or real(y, n, bt, **k)
want = HFEngine.from_model(model, tok).generate(Batch(items=prompts), sp)
eager_calls = len(calls)
assert eager_calls == 2 * (1 + 5), calls  # 2 layers x (the packed prefill + a forward per sampled token)
counts = {}
for on in ("1", "0"):
    os.environ["THINKCRAFT_FUSED_MLP_LORA_COMPILED"] = on
    torch._dynamo.reset()
    calls.clear()
    got = HFEngine.from_model(model, tok, kv_cache="static", compile_decode=True).generate(Batch(items=prompts), sp)
    counts[on] = len(calls)
    assert [c.token_ids for c in got] == [c.token_ids for c in want], on
    diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs))
    assert diff < 0.05, (on, diff)  # bf16: the compiled step's own roundings, as without the op
assert counts["0"] == 2 and counts["1"] == eager_calls, counts  # off: only the eager prefill's 2 calls
print("ok")
"""


def test_the_engines_compiled_decode_takes_the_lora_op_under_the_triton_interpreter() -> None:
    """The engine's compiled decode step (compile_decode) calls the LoRA kernel through its op in every step
    (THINKCRAFT_FUSED_MLP_LORA_COMPILED, on), with the eager engine's tokens; switched off, only the eager prefill
    does."""
    pytest.importorskip("triton", reason="Triton is not installed (torch's CPU wheel may come without it)")
    out = _interpreted(ENGINE_SCRIPT)
    if out.returncode != 0 and "cannot build" in out.stderr:
        pytest.skip("torch.compile cannot build here")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout[-2000:], out.stderr[-4000:])


def test_steps_aside_where_it_does_not_serve(monkeypatch) -> None:
    """On the CPU without the interpreter, over more tokens than FUSED_TOKENS_MAX allows, with gradients, without a fused group, or with the switch off, the MLP's
    own forward runs (the kernel is never called) and the logits are HF's."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused_mlp.serves(torch.device("cpu"), torch.bfloat16)
    model, _ = _lora()
    lora_fast.install(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    fused_proj.install(model)
    want = _logits(model, ids)
    assert fused_mlp.install(model) == model.config.num_hidden_layers
    assert fused_mlp.install(model) == model.config.num_hidden_layers  # idempotent
    called = []
    monkeypatch.setattr(fused_mlp, "silu_mul", lambda y, n: called.append(1) or fused_mlp.reference(y, n).contiguous())
    assert torch.equal(_logits(model, ids), want)  # no interpreter: torch's ops
    real_serves = fused_mlp.serves
    monkeypatch.setattr(fused_mlp, "serves", lambda device, dtype: True)  # as if on a GPU
    monkeypatch.setattr(fused_mlp, "lora_serves", lambda device, dtype: False)  # the stand-in below: the plain kernel
    monkeypatch.setattr(triton_device, "FUSED_TOKENS_MAX", 17)  # the batch's 18 tokens: a prefill's size
    assert torch.equal(_logits(model, ids), want)
    assert not called
    monkeypatch.setattr(triton_device, "FUSED_TOKENS_MAX", 18)  # at the bound: the (stand-in) kernel, every layer
    assert torch.equal(_logits(model, ids), want)
    assert len(called) == model.config.num_hidden_layers
    called.clear()
    monkeypatch.setattr(triton_device, "FUSED_TOKENS_MAX", 17)
    with torch.enable_grad():  # the learner's path: untouched
        model(ids).logits.sum().backward()
    plain, _ = tiny_llama()
    plain = plain.to(torch.bfloat16)
    assert fused_mlp.install(plain) == plain.config.num_hidden_layers  # swapped, but no fused group to read
    _logits(plain, ids)
    assert not called
    fused_mlp.strip(model)
    assert fused_mlp.installed(model) == 0 and torch.equal(_logits(model, ids), want)
    monkeypatch.setenv("THINKCRAFT_FUSED_MLP", "0")  # the A/B switch: torch's ops
    assert fused_mlp.install(model) == 0 and not real_serves(torch.device("cuda"), torch.bfloat16)
    monkeypatch.delenv("THINKCRAFT_FUSED_MLP")  # the default: on
    assert fused_mlp.fused_mlp_on() and fused_mlp.install(model) == model.config.num_hidden_layers


def test_swapped_mlps_pickle_and_strip_with_the_groups() -> None:
    model, _ = tiny_llama()
    model = model.to(torch.bfloat16)
    fused_proj.install(model)
    n = fused_mlp.install(model)
    assert n == model.config.num_hidden_layers
    back = pickle.loads(pickle.dumps(model))
    assert fused_mlp.installed(back) == n
    fused_proj.strip(back)  # a copy for another engine: the groups and the MLPs' forward that reads them
    assert fused_mlp.installed(back) == 0
    assert all(type(m).__name__ == "LlamaMLP" for m in back.modules() if "MLP" in type(m).__name__)


def test_bad_input_is_refused() -> None:
    y = torch.zeros(4, 10, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at least 12"):
        fused_mlp.silu_mul(y, 6)
    with pytest.raises(ValueError, match="contiguous columns"):
        fused_mlp.silu_mul(y.t(), 2)
    bt = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bt \\(r, 2n\\)"):
        fused_mlp.lora_silu_mul(y, 4, bt.t().contiguous())  # bt (8, 2): not (r, 2n)
    with pytest.raises(ValueError, match="float32"):
        fused_mlp.lora_silu_mul(y, 4, bt.float())
    with pytest.raises(ValueError, match="2n \\+ r"):
        fused_mlp.lora_silu_mul(y, 5, bt)  # no A columns left after the 2n


def test_lora_switch_and_group_output() -> None:
    """THINKCRAFT_FUSED_MLP_LORA reads as a switch; a LoRA gate/up group's `folded_output` is its GEMM without the
    low-rank add (`output`'s base columns = folded base + h (sB)ᵀ), None for a group without folded A."""
    assert fused_mlp.fused_lora_on()
    model, _ = _lora()
    lora_fast.install(model)
    groups = fused_proj.install(model)
    g = next(gr for gr in groups if len(gr.members) == 2 and gr.fold)
    x = torch.randn(5, g.weight.shape[1], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        folded, out = g.folded_output(x), g.output(x)
    n = g.n_out
    assert folded.shape == (5, n + sum(g.ranks))
    want = folded[:, :n].clone().addmm_(folded[:, n:], g.bt)
    assert torch.equal(out, want)
    plain, _ = tiny_llama()
    plain = plain.to(torch.bfloat16)
    pg = next(gr for gr in fused_proj.install(plain) if len(gr.members) == 2)
    with torch.no_grad():
        assert pg.folded_output(x) is None  # no adapter: nothing folded


def test_lora_switch_off(monkeypatch) -> None:
    monkeypatch.setenv("THINKCRAFT_FUSED_MLP_LORA", "0")
    assert not fused_mlp.fused_lora_on() and not fused_mlp.lora_serves(torch.device("cpu"), torch.bfloat16)


@pytest.mark.gpu
def test_engine_prefill_with_the_kernel_on_a_gpu(monkeypatch) -> None:
    """On CUDA: the check passes, and a bf16 LoRA model's no-grad forward of 300 tokens through the kernel is close to
    the one through torch's ops."""
    model, ids = _lora_fused_on_cuda()
    dev = ids.device
    assert fused_mlp.serves(dev, torch.bfloat16)
    want = _logits(model, ids)
    fused_mlp.install(model)
    got = _logits(model, ids)
    assert fused_mlp.passed(dev)
    torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)


def _one_flip_range(y: torch.Tensor, n: int, bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowest, highest) of `lora_exact`'s product over g and u each rounded to bf16, or one bf16 step below or above
    that: where the kernel may land when its fp32 sum of the rank products rounds a near-tie the other way."""
    gu = (y[:, :2 * n].double() + y[:, 2 * n:].double() @ bt.double()).to(torch.bfloat16).double()
    ulp = torch.exp2(torch.floor(torch.log2(gu.abs().clamp_min(2.0 ** -126))) - 7)
    g, u, ug, uu = gu[:, :n], gu[:, n:], ulp[:, :n], ulp[:, n:]
    outs = []
    for dg in (-1, 0, 1):
        a = g + dg * ug
        act = (a / (1.0 + torch.exp(-a))).to(torch.bfloat16).double()
        for du in (-1, 0, 1):
            outs.append((act * (u + du * uu)).to(torch.bfloat16).double())
    stacked = torch.stack(outs)
    return stacked.min(0).values.float(), stacked.max(0).values.float()


def test_the_one_flip_range_holds_the_exact_value() -> None:
    """The GPU test's bound: it holds `lora_exact` itself, and is wider where g sits where silu amplifies a step."""
    gen = torch.Generator().manual_seed(3)
    n = 40
    y = (3 * torch.randn(6, 2 * n + 4, generator=gen)).to(torch.bfloat16)
    bt = (0.3 * torch.randn(4, 2 * n, generator=gen)).to(torch.bfloat16)
    lo, hi = _one_flip_range(y, n, bt)
    exact = fused_mlp.lora_exact(y, n, bt).float()
    assert ((lo <= exact) & (exact <= hi)).all() and (hi > lo).any()


@pytest.mark.gpu
def test_lora_kernel_on_a_gpu() -> None:
    """On CUDA: the LoRA kernel's check passes; at the Qwen2.5-0.5B MLP's width (n 4,864, rank 2 x 16) over a decode
    step's and a prefill's rows it is within two bf16 steps of addmm_ + torch's ops, almost every element equal; a
    LoRA model's forward through it is close to torch's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    assert fused_mlp.lora_serves(dev, torch.bfloat16)
    gen = torch.Generator(device="cpu").manual_seed(5)
    n, r = 4864, 32
    bt = torch.zeros(r, 2 * n)
    bt[:16, :n], bt[16:, n:] = 0.05 * torch.randn(16, n, generator=gen), 0.05 * torch.randn(16, n, generator=gen)
    bt = bt.to(dev, torch.bfloat16)
    for rows in (248, 4099):
        y = (2 * torch.randn(rows, 2 * n + r, generator=gen)).to(dev, torch.bfloat16)
        got, exact = fused_mlp.lora_silu_mul(y, n, bt).float(), fused_mlp.lora_exact(y, n, bt).float()
        old = fused_mlp.lora_reference(y, n, bt).float()  # the addmm_ path the kernel replaced
        # within a step of what one flip of g's and u's rounding can give: the kernel's fp32 sum of the rank products
        # rounds a near-tie of `y + h (sB)ᵀ` the other way now and then, and silu(g) amplifies a step of g (at g ~ -5
        # to ~4 steps of silu's; the first run of a two-step bound, H100 2026-12-07: 0.125 apart at a value below 8)
        lo, hi = _one_flip_range(y, n, bt)
        step = exact.abs().clamp_min(1e-3) * 2 ** -7
        assert ((got >= lo - step * 1.01) & (got <= hi + step * 1.01)).all(), (got - exact).abs().max()
        assert ((got - exact).abs() <= 2 * step * 1.01).float().mean() >= 0.999
        assert (got == exact).float().mean() >= 0.98
        # and no further from the float64 values than the addmm_ path it replaced (first run on an H100,
        # 2026-12-07: the kernel more than 2 bf16 steps from that path at some elements, the first bound of this test)
        assert (got - exact).abs().mean() <= (old - exact).abs().mean() * 1.05 + 1e-6
    model, ids = _lora_fused_on_cuda()
    want = _logits(model, ids)
    fused_mlp.install(model)
    got = _logits(model, ids)
    torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)
    mlp = next(m for m in model.modules() if isinstance(m, fused_mlp._FusedMLPMixin))  # compiled: the opaque op
    x = torch.randn(248, 1, model.config.hidden_size, device=dev).to(torch.bfloat16)
    with torch.no_grad():
        eager = mlp(x)
        torch._dynamo.reset()
        comp = torch.compile(mlp.forward)(x)
    torch.testing.assert_close(comp.float(), eager.float(), atol=0.02 * eager.abs().max().item(), rtol=0)
