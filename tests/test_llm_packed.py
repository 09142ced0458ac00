"""Packed training (train/llm_policy/packing.py + the Learner): micro-batches of a token budget laid out as
one dense sequence with varlen attention give the same log-probs, losses and gradients as the padded
computation (fp32, CPU, tiny Llama / Qwen2 / Qwen3 models, LoRA and full fine-tuning), whatever the budget
and the LM-head chunking."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from llm_helpers import spread_lora_b, spread_weights
from thinkcraft.rl import llm_losses as L
from thinkcraft.train import llm_policy as LP
from thinkcraft.train.llm_policy import packing
from thinkcraft.utils.errors import ConfigError

VOCAB = 97


def _model(arch: str, finetune: str = "lora"):
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    from thinkcraft.llm.testing import tiny_llama_config, tiny_qwen3_config

    torch.manual_seed(0)
    if arch == "qwen2":
        model = LP.random_model("tiny", vocab_size=VOCAB)
    else:
        cls, make = {"llama": (LlamaForCausalLM, tiny_llama_config), "qwen3": (Qwen3ForCausalLM, tiny_qwen3_config)}[arch]
        model = cls(make(VOCAB))
    spread_weights(model)
    model = LP.trainable(model, _cfg(finetune=finetune))
    if finetune == "lora":
        spread_lora_b(model)
    return model.eval()


def _cfg(**kw):
    base = dict(model="random:tiny", finetune="lora", lr=1e-2, max_grad_norm=0.0, micro_batch_tokens=1 << 20)
    base.update(kw)
    return LP.LLMPolicyConfig(**base)


def _turns(lengths, seed=0):
    """Turns of (prompt, completion) lengths with random ids; the second turn's last token forced (mask 0)."""
    rng = np.random.default_rng(seed)
    out = []
    for k, (p, c) in enumerate(lengths):
        ids = rng.integers(3, VOCAB, p + c).tolist()
        mask = [1] * c
        if k == 1 and c > 1:
            mask[-1] = 0
        out.append(LP.TurnRecord(obs="", prompt_ids=ids[:p], completion_ids=ids[p:], logprobs=[0.0] * c,
                                 train_mask=mask, text="", finish_reason="stop"))
    return out


LENGTHS = [(5, 4), (3, 6), (9, 2), (2, 1), (7, 5)]


def _rows(model, lengths=LENGTHS, seed=0, common=()):
    """Rows with off-policy old log-probs (current ones + noise: ratios away from 1, some clipped); every
    prompt starts with the token ids `common` (a system prompt), if any."""
    turns = [dataclasses.replace(t, prompt_ids=list(common) + t.prompt_ids) for t in _turns(lengths, seed)]
    rows = LP.build_rows(turns, [1.0, -2.0, 0.5, 1.5, -0.7][: len(lengths)],
                         [1.0, 0.0, 0.5, 1.0, 0.0][: len(lengths)], 0, torch.device("cpu"))
    with torch.no_grad():
        cur = L.token_logprobs(model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits,
                               rows.input_ids)
    noise = torch.randn(cur.shape, generator=torch.Generator().manual_seed(seed)) * 0.3
    rows.old_logp.copy_((cur + noise) * rows.loss_mask)
    return rows


def _learner(cfg, model):
    learner = LP.Learner(cfg, model, None, torch.device("cpu"), None)
    learner.optimizer.step = lambda: None  # keep the weights: compare gradients
    return learner


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _reference(cfg, model, rows, v_star=None):
    """The padded computation, independently: the causal LM's full logits of the whole batch, the losses of
    rl.llm_losses on them, one backward. Returns (loss, grads)."""
    model.zero_grad(set_to_none=True)
    ids, attn, mask = rows.input_ids, rows.attention_mask, rows.loss_mask
    logp = L.token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids)
    ref = None
    if cfg.kl_coef > 0 or cfg.algo == "apo":
        with torch.no_grad():
            if cfg.finetune == "lora":
                with model.disable_adapter():
                    ref = L.token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids)
            else:  # the learner's frozen copy has the same (initial) weights
                ref = L.token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids)
    if cfg.algo == "apo":
        loss = L.apo_loss(L.sequence_logprob(logp, mask), L.sequence_logprob(ref, mask), rows.rewards, v_star,
                          cfg.apo_beta2).loss
    else:
        loss = L.clipped_pg_loss(logp, rows.old_logp, rows.advantages, mask,
                                 clip_eps=cfg.clip_eps, ref_logp=ref, kl_coef=cfg.kl_coef, agg=cfg.loss_agg).loss
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return float(loss), grads


def _assert_same(got, want):
    assert set(got) == set(want)
    assert any(g.abs().sum() > 0 for g in want.values())
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=2e-6, rtol=1e-4, msg=lambda m: f"{n}: {m}")


# ------------------------------------------------------------------------------------------------ plans


def test_boundaries_fill_the_token_budget():
    lens = np.array([4, 3, 5, 9, 2, 2])
    # packed: real tokens; a row over the budget alone
    assert packing.boundaries(lens, 8, 0, True) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    # padded: rows x the longest (4,3 -> 2x4=8; +5 -> 3x5 > 8)
    assert packing.boundaries(lens, 8, 0, False) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert packing.boundaries(lens, 10, 0, True) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert packing.boundaries(lens, 12, 0, True) == [(0, 3), (3, 5), (5, 6)]
    assert packing.boundaries(lens, 100, 2, True) == [(0, 2), (2, 4), (4, 6)]  # the row cap
    assert packing.boundaries(np.array([], dtype=np.int64), 8, 0, True) == []


def test_padded_boundaries_count_rows_times_the_longest():
    lens = np.array([2, 2, 2, 6, 1])
    # 2,2,2 -> 3x2 = 6 <= 12; +6 -> 4x6 = 24 > 12; 6,1 -> 2x6 = 12
    assert packing.boundaries(lens, 12, 0, False) == [(0, 3), (3, 5)]


def test_plan_lays_out_packed_rows_back_to_back():
    """Lengths 3, 5, 2 in a (3, 5) batch: gather walks each row's real tokens, positions restart at 0, cu
    marks the boundaries, and each trained position maps to its packed index and its padded loss slot."""
    lengths = np.array([3, 5, 2])
    mask = np.zeros((3, 4), np.float32)
    mask[0, 1:3] = 1  # row 0 predicts tokens 2, 3 (positions 1, 2)
    mask[1, [2, 4 - 1]] = 1
    mask[2, 0] = 1
    (mb,) = packing.plan(lengths, mask, 100, 0, True, torch.device("cpu"))
    assert (mb.start, mb.end, mb.width, mb.tokens, mb.trained_tokens, mb.trained_seqs) == (0, 3, 5, 10, 5, 3)
    assert mb.gather.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11]
    assert mb.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    assert mb.cu_seqlens.tolist() == [0, 3, 8, 10] and mb.cu_seqlens.dtype == torch.int32
    assert mb.pred.tolist() == [1, 2, 3 + 2, 3 + 3, 8 + 0]
    assert mb.scatter.tolist() == [1, 2, 4 + 2, 4 + 3, 8 + 0]
    (pad,) = packing.plan(lengths, mask, 100, 0, False, torch.device("cpu"))
    assert pad.pred.tolist() == [1, 2, 5 + 2, 5 + 3, 10 + 0] and pad.scatter.tolist() == mb.scatter.tolist()
    assert pad.gather is None and not pad.packed


# ------------------------------------------------------------------------------------------ forward equality


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_packed_logprobs_equal_each_row_alone(arch):
    """Every next-token log-prob of a packed micro-batch (and of a padded one) equals the row's own forward
    through the causal LM: attention stays within each row, positions restart."""
    model = _model(arch)
    rows = _rows(model)
    learner = _learner(_cfg(), model)
    lengths, _, _ = packing.host_rows(rows.attention_mask, rows.loss_mask)
    everything = (np.arange(rows.loss_mask.shape[1])[None] < lengths[:, None] - 1).astype(np.float32)
    got = {}
    with torch.no_grad():
        for packed in (True, False):
            (mb,) = packing.plan(lengths, everything, 1 << 20, 0, packed, torch.device("cpu"))
            got[packed] = learner.logprobs(rows, mb)
        for i, n in enumerate(lengths.tolist()):
            ids = rows.input_ids[i: i + 1, :n]
            want = L.token_logprobs(model(input_ids=ids).logits, ids)[0]
            for packed in (True, False):
                torch.testing.assert_close(got[packed][i, : n - 1], want, atol=1e-5, rtol=1e-5)
                assert not got[packed][i, n - 1:].any()


def test_packed_attention_under_autocast_with_fp32_weights(monkeypatch):
    """Full fine-tuning keeps fp32 weights; under autocast RoPE hands the attention fp32 q/k, which the packed
    function casts to the autocast dtype (the flash kernels take half precision only): CPU autocast runs the
    same branch, and the packed result stays the padded one within bf16 rounding."""
    model = _model("qwen2", "full")
    rows = _rows(model)
    learner = _learner(_cfg(finetune="full"), model)
    lengths, mask, _ = packing.host_rows(rows.attention_mask, rows.loss_mask)
    seen = []

    def recording(q, k, v, *a):  # noqa: ANN001, ANN002, ANN202
        seen.append({q.dtype, k.dtype, v.dtype})
        return packing.sdpa_per_sequence(q, k, v, *a)

    monkeypatch.setitem(packing.TRAIN_KERNELS, "sdpa", recording)
    got = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for packed in (True, False):
            (mb,) = packing.plan(lengths, mask, 1 << 20, 0, packed, torch.device("cpu"))
            got[packed] = learner.logprobs(rows, mb)
    assert seen == [{torch.bfloat16}] * 2  # both layers' kernels got bf16 q, k, v
    torch.testing.assert_close(got[True], got[False], atol=0.1, rtol=0.05)


def test_a_packed_row_does_not_see_its_neighbours():
    model = _model("qwen2")
    rows = _rows(model)
    learner = _learner(_cfg(), model)
    with torch.no_grad():
        before = learner.logprobs(rows, learner.plan(rows)[0])
        rows.input_ids[0, :9] = (rows.input_ids[0, :9] + 1) % VOCAB  # change row 0 only
        after = learner.logprobs(rows, learner.plan(rows)[0])
    assert learner.packed and not torch.equal(before[0], after[0])
    torch.testing.assert_close(before[1:], after[1:], atol=0, rtol=0)


# ------------------------------------------------------------------------------------------ update equality


@pytest.mark.parametrize("finetune,agg,kl", [
    ("lora", "seq-mean-token-mean", 0.0), ("lora", "token-mean", 0.1), ("full", "seq-mean-token-mean", 0.1),
    ("full", "token-mean", 0.0),
])
def test_packed_update_equals_the_padded_computation(finetune, agg, kl):
    """Loss and gradients of a packed, micro-batched (budget 12 tokens: several micro-batches) update with
    chunked log-probs equal the padded whole-batch computation, LoRA and full fine-tuning, both aggregations,
    with and without the KL term (its reference log-probs packed too)."""
    model = _model("qwen2", finetune)
    cfg = _cfg(finetune=finetune, loss_agg=agg, kl_coef=kl, micro_batch_tokens=12, logit_chunk_mib=0.001)
    rows = _rows(model)
    want_loss, want = _reference(cfg, model, rows)
    learner = _learner(cfg, model)
    stats = learner.update(rows)
    assert learner.packed and stats["learner/packed"] == 1.0 and stats["learner/micro_batches"] >= 3
    assert stats["learner/tokens"] == float(sum(p + c for p, c in LENGTHS)) and stats["learner/pad_frac"] == 0.0
    assert stats["losses/loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    assert 0.0 < stats["losses/clip_frac"] < 1.0  # the off-policy ratios clip some tokens
    _assert_same(_grads(model), want)


@pytest.mark.slow  # compiles the tiny decoder's forward and backward (~1 min on a 2-core CPU)
def test_compiled_learner_forward_equals_the_padded_computation(caplog):
    """--learner-compile: the packed update through torch.compile (several micro-batches of different lengths:
    one dynamic graph) gives the padded whole-batch loss and gradients, without falling back to eager."""
    import logging

    model = _model("qwen2")
    cfg = _cfg(learner_compile=True, micro_batch_tokens=12, kl_coef=0.1)
    rows = _rows(model)
    want_loss, want = _reference(cfg, model, rows)
    learner = _learner(cfg, model)
    from torch._dynamo.utils import counters

    counters.clear()
    with caplog.at_level(logging.WARNING):
        stats = learner.update(rows)
    assert not [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert counters["stats"]["unique_graphs"] >= 1  # compiled, not silently eager
    assert stats["learner/micro_batches"] >= 3 and learner._packed_forward
    assert stats["losses/loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    _assert_same(_grads(model), want)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_layer_by_layer_forward_equals_the_padded_computation(arch, monkeypatch):
    """--learner-compile on a plain decoder (Llama, Qwen2/3) compiles one decoder layer that every layer runs, the
    embedding, rotary and final norm eager: that loop (`compat.call_decoder_layer`) is the decoder's own forward,
    shown here with the compile left out (the slow test above compiles), packed micro-batches and a shared
    prefix included: the padded whole-batch loss and gradients."""
    from thinkcraft.llm import compat
    from thinkcraft.utils import fallback

    calls = []

    def eager(fn, what, logger, dynamic=False):  # noqa: ANN001, ANN202 - torch.compile left out
        calls.append(what)
        return fn

    monkeypatch.setattr(fallback, "compiled_or_eager", eager)
    model = _model(arch, finetune="full")
    assert compat.plain_decoder(compat.decoder_of(model))
    cfg = _cfg(finetune="full", learner_compile=True, micro_batch_tokens=16, kl_coef=0.1)
    rows = _rows(model, common=(3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25,
                                26, 27, 28, 29, 30, 31, 32, 33, 34))
    want_loss, want = _reference(cfg, model, rows)
    learner = _learner(cfg, model)
    stats = learner.update(rows)
    assert set(calls) == {"learner layer"} and stats["learner/micro_batches"] >= 2  # the policy and its reference
    assert stats["learner/compiled"] == 1.0
    assert stats["losses/loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    _assert_same(_grads(model), want)


def test_a_compiled_backward_that_fails_falls_back_to_eager(monkeypatch, caplog):
    """A compiler error out of backward() (inductor compiles the backward lazily, past the forward's fallback; seen
    with a `.so` left empty in inductor's cache by a killed run): the learner's compiled functions go eager for good
    with one warning and the update is computed again from zero - the padded loss and gradients, nothing doubled."""
    import logging

    from torch._inductor.exc import InductorError

    from thinkcraft.utils import fallback

    class _BrokenBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            raise InductorError(ImportError("c.main.so: file too short"), None)

    def broken(fn, what, logger, dynamic=False):  # noqa: ANN001, ANN202 - a "compiled" fn whose backward fails
        return fallback.OrEager(lambda *a: _BrokenBackward.apply(fn(*a)), fn, f"compiled {what}", logger)

    monkeypatch.setattr(fallback, "compiled_or_eager", broken)
    model = _model("qwen2", finetune="full")
    cfg = _cfg(finetune="full", learner_compile=True, micro_batch_tokens=16, kl_coef=0.1)
    rows = _rows(model)
    want_loss, want = _reference(cfg, model, rows)
    learner = _learner(cfg, model)
    with caplog.at_level(logging.WARNING):
        stats = learner.update(rows)
    warned = [r.getMessage() for r in caplog.records if "backward unavailable" in r.getMessage()]
    assert len(warned) == 1 and "file too short" in warned[0]
    assert stats["learner/compiled"] == 0.0 and all(f.failed for f in learner._compiled)
    assert stats["losses/loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    _assert_same(_grads(model), want)
    assert learner.update(rows)["losses/loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)  # eager from now
    assert len([r for r in caplog.records if "backward unavailable" in r.getMessage()]) == 1


def test_an_error_out_of_an_eager_backward_is_not_swallowed(monkeypatch):
    """The fallback is for compiled functions only: with nothing compiled, a dynamo-typed error is raised."""
    from torch._inductor.exc import InductorError

    model = _model("qwen2", finetune="full")
    learner = _learner(_cfg(finetune="full", micro_batch_tokens=16), model)  # CPU: eager

    def boom(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise InductorError(RuntimeError("not a compiled path"), None)

    monkeypatch.setattr(learner, "_accumulate", boom)
    with pytest.raises(InductorError):
        learner.update(_rows(model))


def test_the_learner_compiles_by_default_on_cuda_only(monkeypatch):
    """learner_compile None (the default) = auto: a packed CUDA learner with a plain decoder compiles, a CPU one runs
    eager (and says so in `learner/compiled`); True forces it anywhere, False never."""
    from thinkcraft.llm import compat
    from thinkcraft.utils import fallback

    monkeypatch.setattr(fallback, "compiled_or_eager", lambda fn, what, logger, dynamic=False: fn)
    model = _model("qwen2", finetune="full")
    dec = compat.decoder_of(model)
    assert _cfg().learner_compile is None
    learner = _learner(_cfg(micro_batch_tokens=16), model)
    assert learner.packed and not learner.compiles(dec)  # CPU
    assert learner.update(_rows(model))["learner/compiled"] == 0.0
    monkeypatch.setattr(learner, "device", torch.device("cuda"))  # what auto sees on a GPU (nothing runs there)
    assert learner.compiles(dec)
    learner.packed = False  # no varlen kernel with a backward: the padded path, nothing to compile
    assert not learner.compiles(dec)
    assert _learner(_cfg(learner_compile=True), model).compiles(dec)
    monkeypatch.setattr(compat, "plain_decoder", lambda d: False)  # a decoder compiled whole: only when asked
    cuda = _learner(_cfg(), model)
    monkeypatch.setattr(cuda, "device", torch.device("cuda"))
    assert not cuda.compiles(dec) and not _learner(_cfg(learner_compile=False), model).compiles(dec)


def test_apo_update_equals_the_padded_computation():
    model = _model("llama")
    cfg = _cfg(algo="apo", env="arith", micro_batch_tokens=15)
    rows = _rows(model)
    v_star = torch.tensor([0.5, 0.2, 0.1, 0.9, 0.3])
    want_loss, want = _reference(cfg, model, rows, v_star)
    stats = _learner(cfg, model).update(rows, v_star=v_star)
    assert stats["losses/loss"] == pytest.approx(want_loss, rel=1e-5)
    _assert_same(_grads(model), want)


@pytest.mark.parametrize("kw", [
    dict(micro_batch_tokens=1),  # every row alone
    dict(micro_batch_tokens=20, micro_batch_size=2),
    dict(pack=False, micro_batch_tokens=20),  # padded micro-batches
    dict(logit_chunk_mib=0),  # the full logits of every position
    dict(pack=False, logit_chunk_mib=0, micro_batch_size=1),  # the old learner's path
])
def test_layout_budget_and_chunking_do_not_change_the_gradient(kw):
    model = _model("qwen3")
    base = _cfg(loss_agg="seq-mean-token-mean")
    rows = _rows(model, seed=3)
    learner = _learner(base, model)
    learner.update(rows)
    want = _grads(model)
    cfg = _cfg(**{**dict(loss_agg="seq-mean-token-mean"), **kw})
    stats = _learner(cfg, model).update(rows)
    assert stats["learner/packed"] == float(cfg.pack)
    _assert_same(_grads(model), want)


def test_out_of_memory_halves_the_budget_and_redoes_the_update(monkeypatch, caplog):
    """A micro-batch over the device's memory: the update's gradients are computed again from zero with half the
    token budget (kept for the rest of the run, counted, warned) and equal the padded computation; when even
    one-row micro-batches do not fit, a clear error instead of a CUDA traceback."""
    import logging

    from thinkcraft.utils.errors import UserError

    model = _model("qwen2")
    cfg = _cfg(micro_batch_tokens=40)
    rows = _rows(model)
    want_loss, want = _reference(cfg, model, rows)
    learner = _learner(cfg, model)
    real = learner._accumulate
    seen = []

    def small_device(rows_, mbs, v_star):  # "memory" for 20 tokens per micro-batch
        seen.append(max(m.tokens for m in mbs))
        if seen[-1] > 20:
            _ = real(rows_, mbs[:1], v_star)  # some gradients accumulated before the failure: must be dropped
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(rows_, mbs, v_star)

    monkeypatch.setattr(learner, "_accumulate", small_device)
    with caplog.at_level(logging.WARNING):
        stats = learner.update(rows)
    assert learner.micro_batch_tokens == 20 and stats["learner/micro_batch_tokens"] == 20.0
    assert stats["learner/oom_retries"] == 1.0 and seen[-1] <= 20
    assert any("out of device memory" in r.getMessage() for r in caplog.records)
    assert stats["losses/loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    _assert_same(_grads(model), want)

    def no_memory(rows_, mbs, v_star):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(learner, "_accumulate", no_memory)
    with pytest.raises(UserError, match="one row"):
        learner.update(rows)


def test_token_logprobs_reads_every_position():
    model = _model("qwen2")
    rows = _rows(model)
    learner = _learner(_cfg(), model)
    with torch.no_grad():
        got = learner.token_logprobs(rows.input_ids, rows.attention_mask)
        want = L.token_logprobs(model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits,
                                rows.input_ids)
    real = rows.attention_mask[:, 1:].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


def test_config_rejects_bad_learner_budgets():
    for kw, field in ((dict(micro_batch_tokens=-1), "micro-batch-tokens"), (dict(micro_batch_size=-1), "micro-batch-size"),
                      (dict(logit_chunk_mib=-1.0), "logit-chunk-mib"),
                      (dict(learner_compile=True, pack=False), "learner-compile")):
        with pytest.raises(ConfigError, match=field):
            _cfg(**kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernels with a backward need CUDA (none here)")
@pytest.mark.parametrize("finetune,prefixed", [("lora", False), ("full", False), ("lora", True)])
def test_cuda_packed_update_matches_padded_in_bf16(finetune, prefixed):
    """On CUDA a varlen kernel is chosen (forward and backward probed against sdpa, a shared prefix's layout
    included), and a bf16-autocast packed update with chunked log-probs agrees with the padded one with full
    logits (bf16 tolerance, per parameter); `prefixed`: rows with a common 40-token prefix, computed once."""
    dev = torch.device("cuda")
    assert packing.packed_kernel(dev) in packing.CUDA_CANDIDATES
    assert packing.shares_prefix(dev)  # the kernel also computes the shared-prefix layout right
    grads = {}
    for pack in (True, False):
        model = _model("qwen3", finetune)
        rows = _prefixed_rows(model, seed=1) if prefixed else _rows(model, seed=1)
        model.to(dev)
        rows = rows.to(dev)
        cfg = _cfg(finetune=finetune, pack=pack, micro_batch_tokens=64 if prefixed else 16,
                   logit_chunk_mib=0.001 if pack else 0)
        learner = LP.Learner(cfg, model, None, dev, torch.bfloat16)
        learner.optimizer.step = lambda: None
        assert learner.packed == pack
        stats = learner.update(rows)
        assert (stats["learner/prefix_shared_tokens"] > 0) == (prefixed and pack)
        grads[pack] = _grads(model)
    assert set(grads[True]) == set(grads[False])
    for n, want in grads[False].items():
        err = float((grads[True][n] - want).norm() / want.norm().clamp(min=1e-6))
        assert err < 0.05, f"{n}: relative error {err:.3f}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA host syncs (no GPU here)")
def test_cuda_micro_batch_loop_reads_nothing_back():
    """The micro-batch loop (forward, chunked head, KL reference, loss, backward of each) never waits for the
    device with LoRA: with torch's sync debug mode on, no synchronising call happens in it (the plan's one copy
    to the host and the statistics' one read at the end are outside). Full fine-tuning adds torch's own: the
    CUDA embedding backward reads its segment count on the host, once per micro-batch."""
    import warnings

    dev = torch.device("cuda")
    model = _model("qwen3")
    rows = _rows(model, seed=2)
    model.to(dev)
    rows = rows.to(dev)
    learner = LP.Learner(_cfg(micro_batch_tokens=12, logit_chunk_mib=0.001, kl_coef=0.1), model, None, dev,
                         torch.bfloat16)
    inner = learner._accumulate
    syncs = []

    def watched(*a):  # noqa: ANN002, ANN202
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return inner(*a)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                # (torch's one-time notice that the debug mode is a prototype is no synchronising call)
                syncs.extend(str(w.message) for w in caught
                             if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message))

    learner._accumulate = watched
    stats = learner.update(rows)
    assert stats["learner/micro_batches"] >= 3 and stats["learner/packed"] == 1.0
    assert syncs == [], syncs[:3]
    assert learner.optimizer.defaults["fused"] is True  # on CUDA: one fused AdamW kernel per step


def test_public_varlen_attention_takes_what_the_cuda_kernel_passes():
    """The CUDA kernels can't run here; the public API's parameters that `attention._public_varlen` passes
    (causal window, GQA) are checked in every build."""
    import inspect

    varlen = pytest.importorskip("torch.nn.attention.varlen")
    params = inspect.signature(varlen.varlen_attn).parameters
    assert {"window_size", "enable_gqa", "scale"} <= set(params), list(params)


def test_learner_memory_bench_quick_writes_its_rows(tmp_path):
    """bench/learner_memory.py --quick runs every mode on CPU and writes the documented rows (so the GPU run
    is not where it is debugged)."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_learner_memory", root / "bench" / "learner_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "llm_policy_craftax_quick.json"
    out.write_text(json.dumps([{"model_shape": "tiny", "num_envs": 4, "decisions_per_s": 1.0, "card": "x"}]))
    assert mod.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows[0]["decisions_per_s"] == 1.0  # the end-to-end bench's rows are kept
    learner = [r for r in rows if r.get("bench") == "learner"]
    assert {r["mode"] for r in learner} == set(mod.MODES)
    for r in learner:
        assert {"model_shape", "vocab_size", "layout", "logits", "tokens", "learner_s", "learner_tokens_per_s",
                "peak_learner_gb", "micro_batches", "card", "date"} <= set(r), r
        assert r["learner_tokens_per_s"] > 0 and r["vocab_size"] == 4096
        assert r["layout"] == ("packed" if r["mode"].startswith("packed") else "padded")
    packed = next(r for r in learner if r["mode"] == "packed/chunked")
    assert packed["pad_frac"] == 0.0 and packed["logits"] == "chunked"


def test_auto_micro_batch_budget_fills_the_measured_memory():
    from thinkcraft.train.llm_policy.learner import AUTO_FIRST_TOKENS, auto_micro_batch_tokens

    mib, gib = 2**20, 2**30
    assert auto_micro_batch_tokens(1 * mib, 40 * gib) == int(0.85 * 40 * 1024) // 1024 * 1024 == 34816
    assert auto_micro_batch_tokens(2 * mib, 40 * gib) == 17408
    assert auto_micro_batch_tokens(0.01 * mib, 80 * gib) == 65536  # capped
    assert auto_micro_batch_tokens(4 * mib, 8 * gib) == AUTO_FIRST_TOKENS  # never below what just fit
    assert auto_micro_batch_tokens(4 * mib, 8 * gib, headroom=0.5, floor=1024) == 1024  # the host's first budget


def test_micro_batch_tokens_0_measures_once_then_keeps_the_size(monkeypatch, caplog):
    """`micro_batch_tokens=0` (the default): on CUDA the first update's first micro-batch is measured (peak over
    the memory before it, per token) and the next updates get the size that fills 85% of what is left - measured
    once; an out-of-memory afterwards halves it and it is never grown again."""
    import logging

    model = _model("qwen2")
    rows = _rows(model)
    assert LP.LLMPolicyConfig().micro_batch_tokens == 0
    learner = _learner(_cfg(micro_batch_tokens=0), model)
    # the CUDA path, its memory counters simulated: 1 MiB per token over the base, 40 GiB spare
    learner._memory, learner._auto_pending = "device", True
    probes = []
    monkeypatch.setattr(learner, "_memory_probe_start", lambda: probes.append(1) or 1000)
    tokens = {}
    real_micro_loss = learner._micro_loss

    def micro_loss(rows_, mb, v_star):
        tokens["n"] = mb.tokens
        return real_micro_loss(rows_, mb, v_star)

    monkeypatch.setattr(learner, "_micro_loss", micro_loss)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 1000 + tokens["n"] * 2**20)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (38 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 1 * 2**30)
    with caplog.at_level(logging.INFO):
        first = learner.update(rows)
    assert first["learner/micro_batch_tokens"] == 34816.0 and learner.micro_batch_tokens == 34816
    assert any("micro-batches of 34816 tokens" in r.getMessage() for r in caplog.records)
    learner.update(rows)
    assert len(probes) == 1  # measured once
    learner._auto_pending = True  # as if still to measure: an out-of-memory ends the sizing for good
    real = learner._accumulate
    calls = []

    def oom_once(rows_, mbs, v_star):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(rows_, mbs, v_star)

    monkeypatch.setattr(learner, "_accumulate", oom_once)
    learner.update(rows)
    assert learner.micro_batch_tokens == 17408 and not learner._auto_pending and len(probes) == 1


def test_micro_batch_tokens_0_off_cuda_sizes_to_the_host(monkeypatch, caplog):
    """Off CUDA the default budget is measured on the host: 2,048 tokens first (8,192 got the bundled model's
    Craftax run OOM-killed on a 24 GiB CPU), the resident set's peak over that micro-batch per token, then what
    fills half of the memory available - once. Where the peak cannot be reset, the first budget stays."""
    import logging

    from thinkcraft.train.llm_policy import learner as LM
    from thinkcraft.utils import host_memory

    model = _model("qwen2")
    rows = _rows(model)
    monkeypatch.setattr(host_memory, "reset_peak", lambda: False)
    fixed = _learner(_cfg(micro_batch_tokens=0), model)
    assert fixed.micro_batch_tokens == LM.AUTO_FIRST_TOKENS_HOST and not fixed._auto_pending
    fixed.update(rows)
    assert fixed.micro_batch_tokens == LM.AUTO_FIRST_TOKENS_HOST
    # simulated readings: 3 GiB resident before, 1 MiB a token at the peak, 20 GiB available, 1 GiB kept after
    tokens, resets = {}, []
    monkeypatch.setattr(host_memory, "reset_peak", lambda: resets.append(1) or True)
    monkeypatch.setattr(host_memory, "rss_bytes", lambda: (4 if tokens else 3) * 2**30)
    monkeypatch.setattr(host_memory, "peak_rss_bytes", lambda: 3 * 2**30 + tokens["n"] * 2**20)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 20 * 2**30)
    learner = _learner(_cfg(micro_batch_tokens=0), model)
    assert learner.micro_batch_tokens == LM.AUTO_FIRST_TOKENS_HOST and learner._auto_pending
    real_micro_loss = learner._micro_loss

    def micro_loss(rows_, mb, v_star):
        tokens["n"] = mb.tokens
        return real_micro_loss(rows_, mb, v_star)

    monkeypatch.setattr(learner, "_micro_loss", micro_loss)
    with caplog.at_level(logging.INFO):
        learner.update(rows)
    want = int(LM.HOST_HEADROOM * 21 * 1024) // 1024 * 1024  # half of (20 available + 1 the process holds) GiB
    assert learner.micro_batch_tokens == want == 10240 and not learner._auto_pending
    assert any("of host memory per token" in r.getMessage() for r in caplog.records)
    learner.update(rows)
    assert learner.micro_batch_tokens == want and len(resets) == 2  # the check at start + one measurement
    # a reading that fails (a sandbox hiding /proc) keeps the first budget
    monkeypatch.setattr(host_memory, "available_bytes", lambda: None)
    blind = _learner(_cfg(micro_batch_tokens=0), model)
    monkeypatch.setattr(blind, "_micro_loss", micro_loss)
    blind.update(rows)
    assert blind.micro_batch_tokens == LM.AUTO_FIRST_TOKENS_HOST and not blind._auto_pending


def test_host_memory_readings_follow_an_allocation():
    """The host's readings on this machine (Linux): the peak reset to the present, then raised by a touched
    allocation of 256 MiB; the available memory a positive number."""
    from thinkcraft.utils import host_memory

    if not host_memory.reset_peak():
        pytest.skip("/proc/self/clear_refs not writable here: the learner keeps its first budget off CUDA")
    base = host_memory.peak_rss_bytes()
    assert base is not None and abs(base - host_memory.rss_bytes()) < 64 * 2**20
    block = np.ones(256 * 2**20, dtype=np.uint8)  # written: resident
    assert host_memory.peak_rss_bytes() >= base + 200 * 2**20
    del block
    assert host_memory.available_bytes() > 0


# ------------------------------------------------------------------------------------------ a shared prefix


def test_plan_computes_a_shared_prefix_once():
    """Rows of 5, 7, 6 tokens that start with the same 3: the layout is [prefix | row 0's 2 | row 1's 4 | row
    2's 3]; each row's keys are the prefix's then its own (kv_index, cu_k), positions continue after the
    prefix; a trained position inside the prefix reads the shared hidden state, its target the row's own."""
    lengths = np.array([5, 7, 6])
    mask = np.zeros((3, 7), np.float32)
    mask[0, [2, 3]] = 1  # position 2 (the prefix's last) predicts row 0's first own token
    mask[1, 5] = 1
    mask[2, 1] = 1  # inside the prefix
    (mb,) = packing.plan(lengths, mask, 100, 0, True, torch.device("cpu"), prefix=3)
    assert (mb.tokens, mb.shared, mb.trained_tokens, mb.max_len, mb.max_k) == (12, 6, 4, 4, 7)
    assert mb.gather.tolist() == [0, 1, 2, 3, 4, 11, 12, 13, 14, 19, 20, 21]
    assert mb.positions.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 6, 3, 4, 5]]
    assert mb.kv_index.tolist() == [0, 1, 2] + [0, 1, 2, 3, 4] + [0, 1, 2, 5, 6, 7, 8] + [0, 1, 2, 9, 10, 11]
    assert mb.cu_seqlens.tolist() == [0, 3, 5, 9, 12] and mb.cu_k.tolist() == [0, 3, 8, 15, 21]
    assert mb.pred.tolist() == [2, 3, 7, 1] and mb.target.tolist() == [3, 4, 8 + 6, 16 + 2]
    assert mb.scatter.tolist() == [2, 3, 6 + 5, 12 + 1]
    summary = packing.layout_summary([mb])
    assert summary["learner/tokens"] == 18 and summary["learner/tokens_computed"] == 12
    assert summary["learner/prefix_shared_tokens"] == 6
    # the budget counts computed tokens: 3 + 2 + 4 = 9 fit 9, row 2 starts a micro-batch of its own
    assert [(m.start, m.end, m.tokens) for m in packing.plan(lengths, mask, 9, 0, True, torch.device("cpu"),
                                                              prefix=3)] == [(0, 2, 9), (2, 3, 6)]
    with pytest.raises(ValueError, match="every row longer"):
        packing.plan(lengths, mask, 100, 0, True, torch.device("cpu"), prefix=5)


PREFIX = 40  # over packing.MIN_SHARED_PREFIX


def _prefixed_rows(model, seed=0):
    """`_rows` whose every prompt starts with the same PREFIX tokens (a system prompt)."""
    return _rows(model, seed=seed, common=np.random.default_rng(99).integers(3, VOCAB, PREFIX).tolist())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_shared_prefix_logprobs_equal_each_row_alone(arch):
    """Every next-token log-prob of a micro-batch that computes the common prefix once - positions inside the
    prefix too - equals the row's own forward through the causal LM."""
    model = _model(arch)
    rows = _prefixed_rows(model)
    learner = _learner(_cfg(), model)
    lengths, _, common = packing.host_rows(rows.attention_mask, rows.loss_mask, rows.input_ids)
    assert common >= PREFIX
    everything = (np.arange(rows.loss_mask.shape[1])[None] < lengths[:, None] - 1).astype(np.float32)
    with torch.no_grad():
        (mb,) = packing.plan(lengths, everything, 1 << 20, 0, True, torch.device("cpu"), prefix=PREFIX)
        assert mb.shared == (len(lengths) - 1) * PREFIX
        got = learner.logprobs(rows, mb)
        for i, n in enumerate(lengths.tolist()):
            ids = rows.input_ids[i: i + 1, :n]
            want = L.token_logprobs(model(input_ids=ids).logits, ids)[0]
            torch.testing.assert_close(got[i, : n - 1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [1 << 20, 80])
def test_shared_prefix_update_equals_the_padded_computation(budget):
    """The learner finds the rows' common prefix itself (`learner_share_prefix`, the default) and its loss and
    gradients equal the padded whole-batch computation - in one micro-batch and in several."""
    model = _model("qwen2")
    cfg = _cfg(micro_batch_tokens=budget)
    rows = _prefixed_rows(model)
    want_loss, want = _reference(cfg, model, rows)
    stats = _learner(cfg, model).update(rows)
    assert stats["learner/prefix_shared_tokens"] > 0
    assert stats["learner/tokens"] == stats["learner/tokens_computed"] + stats["learner/prefix_shared_tokens"]
    assert stats["losses/loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    _assert_same(_grads(model), want)
    model.zero_grad(set_to_none=True)
    off = _learner(_cfg(micro_batch_tokens=budget, learner_share_prefix=False), model).update(rows)
    assert off["learner/prefix_shared_tokens"] == 0 and off["learner/tokens"] == stats["learner/tokens"]


def test_a_kernel_that_fails_the_prefix_probe_packs_without_sharing(monkeypatch):
    """A device whose varlen kernel fails the shared-prefix probe still packs, every row whole (not padded)."""
    model = _model("qwen2")
    rows = _prefixed_rows(model)
    want_loss, want = _reference(_cfg(), model, rows)
    monkeypatch.setattr(packing, "shares_prefix", lambda device: False)
    stats = _learner(_cfg(), model).update(rows)
    assert stats["learner/packed"] == 1.0 and stats["learner/prefix_shared_tokens"] == 0
    assert stats["losses/loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    _assert_same(_grads(model), want)
