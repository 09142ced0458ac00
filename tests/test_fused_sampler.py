"""The one-pass sampler (llm/hf/fused_sampler.py): its Triton kernel run on the CPU by Triton's interpreter, in a
fresh process (TRITON_INTERPRET must be set before the kernel is defined): greedy rows equal torch's argmax, the
logsumexp equals torch's, masked tokens are never drawn, the draws follow softmax(logits / T), the seed advances;
in the engine, a mixed greedy / sampled batch gives the torch path's greedy tokens and log-probs equal to a
reference forward's. Where it does not serve (the CPU without the interpreter, the switch off) the torch path runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from thinkcraft.llm.hf import fused_sampler as FS
    from thinkcraft.llm.hf.rows import sample_rows_lse

    torch.manual_seed(0)
    x = torch.randn(5, 2500) * 3
    x[:, ::5] = float("-inf")
    assert FS.fused_sampler_serves(x), "the interpreter's kernel did not pass its check"
    assert FS._CHECKS.state[("cpu", None)] == "four"  # the four-numbers-a-call noise passed first
    temp = torch.tensor([0.0, 1.0, 0.7, 0.0, 3.0])
    seed = torch.tensor([11])
    tok, lse = FS.sample_and_lse(x, temp, seed)
    assert int(seed) == 12
    assert tok[0] == x[0].argmax() and tok[3] == x[3].argmax()
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), atol=1e-4, rtol=1e-5)
    assert bool((tok % 5 != 0).all())  # never a masked token
    tok1, lse1 = FS.sample_and_lse(x, temp, seed, "one")  # the other noise variant: the same greedy rows and sums
    assert tok1[0] == tok[0] and tok1[3] == tok[3] and bool((tok1 % 5 != 0).all()) and int(seed) == 13
    torch.testing.assert_close(lse1, lse)

    # the draws: 3 rows x 400 of a 6-token vocabulary against softmax(logits / T)
    base = torch.tensor([[2.0, 0.5, -1.0, 1.0, 0.0, -3.0], [1.0, 1.0, 0.0, -0.5, 2.0, 0.3],
                         [0.0, 3.0, 1.0, -2.0, 0.5, 0.5]])
    t = torch.tensor([1.0, 0.5, 2.0])
    n = 400
    draws = FS.sample_and_lse(base.repeat_interleave(n, 0), t.repeat_interleave(n), seed)[0].view(3, n)
    emp = torch.stack([torch.bincount(draws[r], minlength=6) for r in range(3)]).float() / n
    want = torch.softmax(base / t[:, None], -1)
    assert (emp - want).abs().max() < 0.09, (emp, want)  # 3.6 standard errors of 400 draws at p = 0.5

    # the dispatcher: top-p and a per-call generator keep the torch path (no logsumexp handed back)
    tp = torch.ones(5)
    assert sample_rows_lse(x, temp, tp, True, False, None, seed)[1] is not None
    assert sample_rows_lse(x, temp, tp * 0.9, True, True, None, seed)[1] is None
    assert sample_rows_lse(x, temp, tp, True, False, torch.Generator().manual_seed(0), seed)[1] is None

    # in the engine: a greedy row and a sampled row in one batch (the kernel serves both)
    sys.path.insert(0, sys.argv[1])
    from llm_helpers import forward_logprobs
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.protocol import GenerationRequest, SamplingParams
    from thinkcraft.llm.testing import tiny_llama

    model, tok_ = tiny_llama(seed=3)
    prompts = [list(tok_("Count the stones", add_special_tokens=False)["input_ids"]),
               list(tok_("Then the trees", add_special_tokens=False)["input_ids"])]
    sps = [SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=True),
           SamplingParams(max_new_tokens=4, temperature=1.0, logprobs=True)]

    def run(eng):
        hs = [eng.submit(GenerationRequest(p, sp)) for p, sp in zip(prompts, sps)]
        out = {}
        while len(out) < 2:
            eng.step()
            out.update({r.handle: r for r in eng.poll()})
        return [out[h].completion for h in hs]

    before = FS.launches
    fused = run(HFEngine.from_model(model, tok_, max_slots=2))
    assert FS.launches >= before + 4, (before, FS.launches)  # the kernel sampled every decode step
    import os
    os.environ["THINKCRAFT_FUSED_SAMPLER"] = "0"
    before = FS.launches
    torch_path = run(HFEngine.from_model(model, tok_, max_slots=2))
    assert FS.launches == before
    assert fused[0].token_ids == torch_path[0].token_ids, (fused[0].token_ids, torch_path[0].token_ids)
    for c, p in zip(fused, prompts):
        ref = forward_logprobs(model, p, c.token_ids)
        assert abs(sum(c.logprobs) - float(sum(ref))) < 1e-3 * len(ref), (c.logprobs, ref)
    print("ok")
""")


def test_kernel_and_engine_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (torch's CPU wheel may come without it)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("THINKCRAFT_FUSED_SAMPLER", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "tests")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout[-2000:], out.stderr[-4000:])


def test_the_torch_path_where_the_kernel_does_not_serve(monkeypatch) -> None:
    from thinkcraft.llm.hf import fused_sampler as FS
    from thinkcraft.llm.hf.rows import sample_rows_lse
    from thinkcraft.utils.errors import UserError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(3, 50)
    assert not FS.fused_sampler_serves(x)  # the CPU, no interpreter
    tok, lse = sample_rows_lse(x, torch.ones(3), torch.ones(3), True, False, None, torch.zeros(1, dtype=torch.long))
    assert lse is None and tok.shape == (3,)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("THINKCRAFT_FUSED_SAMPLER", "0")
    assert not FS.fused_sampler_serves(x)
    monkeypatch.setenv("THINKCRAFT_FUSED_SAMPLER", "yes")
    with pytest.raises(UserError, match="THINKCRAFT_FUSED_SAMPLER must be 0 or 1"):
        FS.fused_sampler_serves(x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernel needs a CUDA GPU (none here)")
def test_kernel_on_gpu_at_qwen_vocabulary() -> None:
    """On CUDA at 128 slots of Qwen's vocabulary: greedy rows and the logsumexp equal torch's, and one call replays
    from a CUDA graph with new noise each time (the seed advances inside the graph)."""
    from thinkcraft.llm.hf import fused_sampler as FS

    dev = torch.device("cuda")
    x = torch.randn(128, 151936, device=dev) * 4
    temp = torch.ones(128, device=dev)
    temp[::4] = 0
    assert FS.fused_sampler_serves(x) and FS._CHECKS.state[("cuda", x.device.index)] in FS.VARIANTS
    seed = torch.zeros(1, dtype=torch.long, device=dev)
    tok, lse = FS.sample_and_lse(x, temp, seed)
    assert bool((tok[::4] == x[::4].argmax(-1)).all())
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), atol=1e-3, rtol=1e-5)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        FS.sample_and_lse(x, temp, seed)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out, _ = FS.sample_and_lse(x, temp, seed)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert not torch.equal(first[1::4], out[1::4])  # new noise: the sampled rows moved
    assert torch.equal(first[::4], out[::4])  # the greedy rows did not


def test_sampler_probe_quick_writes_its_rows(tmp_path) -> None:
    """bench/probes/sampler_probe.py --quick (CPU: torch's sampler only) prints and writes its documented row."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("sampler_probe", ROOT / "bench" / "probes" / "sampler_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "rows.json"
    assert mod.main(["--quick", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["slots"] == 8 and row["vocab"] == 4096 and row["torch_ms"] > 0
    assert row["fused_ms"] is None and row["speedup"] is None and {"card", "date"} <= set(row)
