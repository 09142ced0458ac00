"""The split-KV decode attention (llm/hf/split_decode.py): its Triton kernels run on the CPU by Triton's interpreter,
in a fresh process (TRITON_INTERPRET must be set before the kernels are defined): equal to a float64 reference over
rows of 1 key to the full width, with the shared prefix read by some rows and not others, without a prefix, with
chunks smaller than a row, the partials written for the group's heads only or as the whole padded tile, through torch.compile (the custom op's fake); in the engine, greedy tokens and log-probs
equal to the matmul path's with a shared prefix. Where it does not serve (the CPU without the interpreter, the
switch off) the engine keeps its other decode attention."""

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
    import os
    import torch
    from thinkcraft.llm.hf import split_decode as SD

    gen = torch.Generator().manual_seed(0)
    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    # the shared prefix read for blocks of rows (the default, and blocks of 4: several blocks, the last in part;
    # GQA groups of 1 padded to a 16-row tile, a group of 32 at 4 rows a program) and one row a program (=0)
    for rows in ("", "4", "0"):
        os.environ["THINKCRAFT_SPLIT_PREFIX_ROWS"] = rows
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            for hkv, g, d in ((2, 7, 64), (3, 1, 32), (1, 4, 80), (1, 32, 16)):
                s, cols, pcap = 6 if rows != "4" else 11, 300, 40
                q = rnd(s, hkv * g, 1, d, dtype=dtype)
                kc, vc = rnd(s, hkv, cols, d, dtype=dtype), rnd(s, hkv, cols, d, dtype=dtype)
                pk, pv = rnd(1, hkv, pcap, d, dtype=dtype), rnd(1, hkv, pcap, d, dtype=dtype)
                key_len = torch.tensor([1, cols, 32, 33, 150, 64, 2, 299, 31, 40, 41][:s], dtype=torch.int32)
                prefix_n = torch.tensor([pcap, 0, 7, pcap, 0, 1, pcap, pcap, 0, 39, pcap][:s], dtype=torch.int32)
                for chunk in (SD.CHUNK, 32):  # one chunk a row, and many (the combine across chunks)
                    for args in ((pk, pv, prefix_n), (None, None, None)):
                        got = SD.split_decode_attention(q, kc, vc, key_len, *args, d ** -0.5, chunk)
                        assert got.shape == q.shape and got.dtype == dtype
                        want = SD.reference(q, kc, vc, key_len, *args, d ** -0.5)
                        err = float((got.double() - want).abs().max())
                        assert err < tol, (rows, dtype, hkv, g, d, chunk, args[0] is None, err)
    os.environ.pop("THINKCRAFT_SPLIT_PREFIX_ROWS")

    # the partials' whole padded tile written and read (THINKCRAFT_SPLIT_PARTIAL_ROWS=0, the A/B switch; the default
    # writes the group's heads and dims only): the same attention, by rows of 8 and one row a program
    os.environ["THINKCRAFT_SPLIT_PARTIAL_ROWS"] = "0"
    for rows in ("", "0"):
        os.environ["THINKCRAFT_SPLIT_PREFIX_ROWS"] = rows
        for hkv, g, d in ((2, 7, 64), (1, 4, 80)):
            q, kc, vc = rnd(5, hkv * g, 1, d), rnd(5, hkv, 90, d), rnd(5, hkv, 90, d)
            pk, pv = rnd(1, hkv, 20, d), rnd(1, hkv, 20, d)
            kl = torch.tensor([1, 90, 32, 33, 50], dtype=torch.int32)
            pn = torch.tensor([20, 0, 7, 20, 1], dtype=torch.int32)
            for args in ((pk, pv, pn), (None, None, None)):
                got = SD.split_decode_attention(q, kc, vc, kl, *args, d ** -0.5, 32)
                err = float((got.double() - SD.reference(q, kc, vc, kl, *args, d ** -0.5)).abs().max())
                assert err < 1e-4, (rows, hkv, g, d, args[0] is None, err)
    os.environ.pop("THINKCRAFT_SPLIT_PARTIAL_ROWS")
    os.environ.pop("THINKCRAFT_SPLIT_PREFIX_ROWS")

    # a float32 query over half-precision keys (no autocast): computed in the keys' dtype, returned in the query's
    q, kc, vc = rnd(2, 4, 1, 64), rnd(2, 2, 50, 64, dtype=torch.bfloat16), rnd(2, 2, 50, 64, dtype=torch.bfloat16)
    kl = torch.tensor([50, 3], dtype=torch.int32)
    out = SD.split_decode_attention(q, kc, vc, kl, None, None, None, 0.125)
    assert out.dtype == torch.float32
    assert float((out.double() - SD.reference(q.bfloat16(), kc, vc, kl, None, None, None, 0.125)).abs().max()) < 3e-2

    # through torch.compile: the custom op is one opaque call (its fake gives the shape)
    q, kc, vc = rnd(3, 4, 1, 64), rnd(3, 2, 40, 64), rnd(3, 2, 40, 64)
    kl = torch.tensor([40, 1, 17], dtype=torch.int32)
    f = torch.compile(lambda a, b, c, n: SD.split_decode_attention(a, b, c, n, None, None, None, 0.125) * 2,
                      backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(f(q, kc, vc, kl), SD.split_decode_attention(q, kc, vc, kl, None, None, None, 0.125) * 2)

    # the check: passes on the interpreter, per (device, dtype, head dim, group)
    cpu = torch.device("cpu")
    assert SD.meta(cpu, torch.float32, 16, 4, 2) == SD.SplitDecode(SD.CHUNK) and SD.passed(cpu)
    assert SD.meta(cpu, torch.float32, 16, 3, 2) is None  # query heads not a multiple of the KV heads

    # in the engine: a shared prefix read by two rows, a third row without it; greedy tokens and log-probs equal to
    # the matmul path's (the engine on the CPU decodes with matmuls where the split decode does not serve)
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.protocol import GenerationRequest, SamplingParams
    from thinkcraft.llm.testing import tiny_llama

    model, tok = tiny_llama(seed=5)
    ids = lambda t: list(tok(t, add_special_tokens=False)["input_ids"])
    prefix = ids("You play a game of stones and trees. Answer with one word.")
    reqs = [(prefix + ids(" Count the stones"), len(prefix)), (prefix + ids(" Then the trees, please"), len(prefix)),
            (ids("No instructions here"), 0)]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=True)

    def run():
        eng = HFEngine.from_model(model, tok, max_slots=4)
        hs = [eng.submit(GenerationRequest(p, sp, prefix_len=n)) for p, n in reqs]
        out = {}
        while len(out) < len(hs):
            eng.step()
            out.update({r.handle: r for r in eng.poll()})
        return [out[h].completion for h in hs], eng.decode_metrics()

    before = SD.launches
    split, m = run()
    assert m["split_decode"] == 1.0 and SD.launches >= before + 5 * 2, (m["split_decode"], before, SD.launches)
    os.environ["THINKCRAFT_SPLIT_DECODE"] = "0"
    before = SD.launches
    plain, m = run()
    assert m["split_decode"] == 0.0 and SD.launches == before
    for a, b in zip(split, plain):
        assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3, (a.logprobs, b.logprobs)
    print("ok")
""")


def test_kernels_and_engine_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (torch's CPU wheel may come without it)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("THINKCRAFT_SPLIT_DECODE", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout[-2000:], out.stderr[-4000:])


def test_does_not_serve_without_a_gpu_or_with_the_switch_off(monkeypatch) -> None:
    from thinkcraft.llm.hf import split_decode as SD
    from thinkcraft.utils.errors import UserError

    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert SD.meta(cpu, torch.float32, 64, 14, 2) is None  # the CPU without the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("THINKCRAFT_SPLIT_DECODE", "0")
    assert SD.meta(cpu, torch.float32, 64, 14, 2) is None
    monkeypatch.setenv("THINKCRAFT_SPLIT_DECODE", "on")
    with pytest.raises(UserError, match="THINKCRAFT_SPLIT_DECODE must be 0 or 1"):
        SD.meta(cpu, torch.float32, 64, 14, 2)
    for bad in ("3", "-1", "256", "many"):
        monkeypatch.setenv("THINKCRAFT_SPLIT_PREFIX_ROWS", bad)
        with pytest.raises(UserError, match="THINKCRAFT_SPLIT_PREFIX_ROWS must be 0 or a power of two"):
            SD.prefix_rows()
    monkeypatch.setenv("THINKCRAFT_SPLIT_PREFIX_ROWS", "0")
    assert SD.prefix_rows() == 0
    monkeypatch.delenv("THINKCRAFT_SPLIT_PREFIX_ROWS")
    assert SD.prefix_rows() == SD.PREFIX_ROWS
    from llm_helpers import check_env_switch

    # the defaults: the partials of the group's heads only; the prefix on a side stream (on CUDA only: `_run`)
    check_env_switch(monkeypatch, "THINKCRAFT_SPLIT_PARTIAL_ROWS", SD.partial_rows_only, True, bad="padded")
    check_env_switch(monkeypatch, "THINKCRAFT_SPLIT_PREFIX_STREAM", SD.prefix_stream_on, True)


def _cuda_case(s: int, cols: int, pcap: int, prefix: int, reads: float) -> tuple:
    """A bf16 decode case on CUDA at Qwen2.5-0.5B's attention shape (2 KV heads x 7, 64-dim), the split decode's check
    passed: q, the slot caches (`cols` columns), the prefix copy (`pcap`), random key lengths, and `prefix` prefix
    columns for a `reads` share of the rows."""
    from thinkcraft.llm.hf import split_decode as SD

    dev, dt, hkv, g, d = torch.device("cuda"), torch.bfloat16, 2, 7, 64
    assert SD.serves(dev, dt, d, g)
    q = torch.randn(s, hkv * g, 1, d, device=dev, dtype=dt)
    kc, vc = (torch.randn(s, hkv, cols, d, device=dev, dtype=dt) for _ in range(2))
    pk, pv = (torch.randn(1, hkv, pcap, d, device=dev, dtype=dt) for _ in range(2))
    key_len = torch.randint(1, cols, (s,), device=dev, dtype=torch.int32)
    prefix_n = torch.where(torch.rand(s, device=dev) < reads, prefix, 0).to(torch.int32)
    return q, kc, vc, pk, pv, key_len, prefix_n


def _replayed_after_new_lengths(call, key_len: torch.Tensor, cols: int) -> torch.Tensor:  # noqa: ANN001
    """`call()` warmed on a side stream, captured into a CUDA graph, the key lengths redrawn in place, the graph
    replayed: its output (the grid is the cache's, the counts are read on the device)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = call()
    key_len.copy_(torch.randint(1, cols, key_len.shape, device=key_len.device, dtype=torch.int32))
    graph.replay()
    return got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernels need a CUDA GPU (none here)")
def test_split_decode_on_gpu_equals_flash_attention_and_replays() -> None:
    """On CUDA at the Qwen2.5-0.5B decode shape (80 rows, 2 KV heads x 7, 64-dim, 1,281 columns, a 128-token
    prefix): equal to the FlashAttention path (slot call + prefix call + merge) and to the reference; replayed from
    a CUDA graph after the key lengths change (the grid is the cache's, the counts are read on the device)."""
    from thinkcraft.llm import attention as A
    from thinkcraft.llm.hf import split_decode as SD

    s, d, cols, pcap = 80, 64, 1281, 128
    q, kc, vc, pk, pv, key_len, prefix_n = _cuda_case(s, cols, pcap, 120, 0.8)
    reads = prefix_n > 0
    scale = d ** -0.5
    out = SD.split_decode_attention(q, kc, vc, key_len, pk, pv, prefix_n, scale)
    o, lse = A.slot_decode_attention(q, kc, vc, key_len, cols, scale)
    o_p, lse_p = A.prefix_decode_attention(q, pk, pv, scale, prefix_len=120)
    flash = A.merge_attention(o_p, torch.where(reads[:, None], lse_p, A.NO_KEYS_LSE)[..., None], o, lse[..., None])
    assert float((out.float() - flash.float()).abs().max()) < 2e-2
    want = SD.reference(q[:8], kc[:8], vc[:8], key_len[:8], pk, pv, prefix_n[:8], scale)
    assert float((out[:8].double().cpu() - want).abs().max()) < 2e-2
    got = _replayed_after_new_lengths(lambda: SD.split_decode_attention(q, kc, vc, key_len, pk, pv, prefix_n, scale),
                                      key_len, cols)
    torch.testing.assert_close(got, SD.split_decode_attention(q, kc, vc, key_len, pk, pv, prefix_n, scale))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs a CUDA GPU (none here)")
def test_prefix_on_a_side_stream_equals_one_stream_and_replays(monkeypatch) -> None:
    """THINKCRAFT_SPLIT_PREFIX_STREAM (on): the shared prefix's programs on a side stream beside the own chunks give the
    one-stream result, eagerly and replayed from a CUDA graph captured with the two branches (after the key lengths
    change), on a stream other than the default."""
    from thinkcraft.llm.hf import split_decode as SD

    s, cols, pcap = 96, 700, 680
    q, kc, vc, pk, pv, key_len, prefix_n = _cuda_case(s, cols, pcap, pcap, 0.9)
    scale = q.shape[-1] ** -0.5
    monkeypatch.setenv("THINKCRAFT_SPLIT_PREFIX_STREAM", "0")
    one = SD.split_decode_attention(q, kc, vc, key_len, pk, pv, prefix_n, scale)
    monkeypatch.setenv("THINKCRAFT_SPLIT_PREFIX_STREAM", "1")
    two = SD.split_decode_attention(q, kc, vc, key_len, pk, pv, prefix_n, scale)
    assert SD._SIDE_STREAMS and torch.equal(two, one)  # the same programs, the same values
    got = _replayed_after_new_lengths(lambda: SD.split_decode_attention(q, kc, vc, key_len, pk, pv, prefix_n, scale),
                                      key_len, cols)
    torch.cuda.synchronize()
    monkeypatch.setenv("THINKCRAFT_SPLIT_PREFIX_STREAM", "0")
    torch.testing.assert_close(got, SD.split_decode_attention(q, kc, vc, key_len, pk, pv, prefix_n, scale),
                               atol=0, rtol=0)


def test_decode_attention_probe_quick_writes_its_rows(tmp_path, monkeypatch) -> None:
    """bench/probes/decode_attention_probe.py --quick (CPU: no kernel timed) prints and writes its documented row,
    and refuses a mean key count its width cannot hold."""
    import importlib.util
    import json

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = importlib.util.spec_from_file_location("decode_attention_probe",
                                                  ROOT / "bench" / "probes" / "decode_attention_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "rows.json"
    assert mod.main(["--quick", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["rows"] == 4 and row["width"] == 64 and row["flash_ms"] is None and row["split_ms"] is None
    assert {"card", "date", "speedup", "mean_keys", "prefix"} <= set(row)
    with pytest.raises(SystemExit):
        mod.main(["--width", "100", "--mean-keys", "80"])
    if not torch.cuda.is_available():
        assert mod.main(["--out", str(out)]) == 2  # nothing to time without a GPU: said, not an empty row
