"""The engine's slot KV cache and compiled decode step survive a learner update (CPU, tiny random model + LoRA).

A rollout sizes the cache from its own first prompts, so the next rollout may reserve a little more; an exact
fit was outgrown at the first rollout after the first update, and the new cache recompiled the decode step
and re-recorded its CUDA graphs (~100 s on an H100). The cache now keeps headroom, and its default KV budget
(half the free GPU memory) is measured once, not again after a learner has taken memory.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from thinkcraft.envs.textenvs import StepResult
from thinkcraft.llm.hf import HFEngine
from thinkcraft.llm.protocol import Batch, SamplingParams
from thinkcraft.train import llm_policy as LP
from thinkcraft.train.llm_policy.loop import Carry, update_on

SAMPLING = SamplingParams(max_new_tokens=8, logprobs=True)


class GrowingEnv:
    """3 turns; the first observation of seed s has s filler words (a later rollout's prompts are longer, as
    Craftax's vary from reset to reset)."""

    name = "growing"
    system_prompt = "Reply with a number."
    max_turns = 3

    def reset(self, seeds):
        self.t = [0] * len(seeds)
        self.seeds = list(seeds)
        return [f"turn 0 of seed {s}" + " more" * s for s in seeds]

    def active_indices(self):
        return [i for i, t in enumerate(self.t) if t < 3]

    def step(self, actions, indices=None):
        active = self.active_indices() if indices is None else list(indices)
        for i in active:
            self.t[i] += 1
        done = np.array([self.t[i] >= 3 for i in active])
        rewards = np.array([(i + self.t[i]) % 3 for i in active], np.float32)  # samples differ: advantages
        return StepResult(["" if d else f"turn {self.t[i]}" for i, d in zip(active, done)], rewards, done,
                          np.zeros(len(active), bool), [{} for _ in active])

    def counters(self):
        return {}


@pytest.fixture(scope="module")
def policy():
    cfg = LP.LLMPolicyConfig(model="random:tiny", finetune="lora", max_turns=3, lr=1e-2)
    texts = ["turn 0 of seed 3 more more Reply with a number."] * 20
    model, tok = LP.load_policy(cfg, texts, torch.device("cpu"), torch.float32)
    return cfg, model, tok


def _rollout_update_rollout(cfg, model, tok, engine, seeds, device=torch.device("cpu"), autocast=None):
    """Rollout of seeds[0] -> one learner update -> rollout of seeds[1] (as `loop.train_step` does it);
    returns each rollout's reservation (tokens) and the engine's cache after it."""
    reserved, caches = [], []
    reserve = engine.reserve
    engine.reserve = lambda slots, tokens, prefix=0: (reserved.append(tokens), reserve(slots, tokens, prefix))
    learner = LP.Learner(cfg, model, tok, device, autocast)
    carry = Carry()
    for k, s in enumerate(seeds):
        eps = LP.rollout(GrowingEnv(), engine, tok, seeds=s, samples_per_seed=2, sampling=SAMPLING, history_turns=-1,
                         gen_context=learner.autocast)
        caches.append(engine._batcher.kv)
        if k == 0:
            before = [p.detach().clone() for p in learner.params]
            stats, carry = update_on(cfg, learner, tok, eps, carry)
            assert stats["losses/grad_norm"] > 0
            assert any(not torch.equal(a, p) for a, p in zip(before, learner.params))  # the weights moved
    return reserved, caches


def _would_have_grown(reserved: list[int]) -> bool:
    """The second reservation outgrows an exact fit of the first (64-column multiples, `cache._ROUND_TOKENS`)."""
    return -(-reserved[1] // 64) > -(-reserved[0] // 64)


def test_the_cache_survives_a_learner_update_and_a_larger_reservation(policy) -> None:
    cfg, model, tok = policy
    engine = LP.make_engine(model, tok, cfg)
    torch.manual_seed(0)
    reserved, (kv0, kv1) = _rollout_update_rollout(cfg, model, tok, engine, [[11, 12], [18, 19]])
    assert _would_have_grown(reserved), reserved  # the premise: an exact fit would be rebuilt
    assert kv1 is kv0 and engine.decode_metrics()["slot_tokens"] >= reserved[1] and engine.pending() == 0


def test_the_default_kv_budget_is_measured_once(policy, monkeypatch) -> None:
    """The CUDA default budget (half the free memory) is measured at the first allocation and kept: a cache
    that must grow after a learner took memory keeps its slots (measured again, it lost five of eight).
    The device's free memory is faked: the path is the CUDA one, run on the CPU."""
    import thinkcraft.llm.hf.cache as C

    _, model, tok = policy
    per_token = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x head dim 16 x fp32
    free = [2 * 8 * 400 * per_token, 8 * 400 * per_token // 2]  # then a learner takes three quarters
    measured: list[int] = []

    def fake_free(device):
        measured.append(free[min(len(measured), 1)])
        return measured[-1]

    monkeypatch.setattr(C, "_device_free_bytes", fake_free)
    engine = HFEngine.from_model(model, tok)
    engine.generate(Batch(items=[[10 + i, 11, 12] for i in range(8)]), SamplingParams(max_new_tokens=3))
    first = engine.decode_metrics()
    assert first["slots"] == 8 and first["slot_tokens"] == 128  # 64 wanted, headroom: the budget holds it
    engine.reserve(8, 200)  # outgrows the cache: a new one, in the same budget
    engine.generate(Batch(items=[[10 + i, 11, 12] for i in range(8)]), SamplingParams(max_new_tokens=3))
    grown = engine.decode_metrics()
    assert grown["slots"] == 8 and 200 <= grown["slot_tokens"] <= 320 and len(measured) == 1
    engine.free_cache()  # memory given back: the next cache measures again
    engine.generate(Batch(items=[[10, 11, 12]]), SamplingParams(max_new_tokens=3))
    assert len(measured) == 2


def _graphs_after_each_rollout(monkeypatch) -> list[int]:
    """A list that gets dynamo's count of graphs compiled *during* each `LP.rollout` call: the learner's update
    between two rollouts compiles graphs of its own where the learner compiles (CUDA, `learner_compile` auto), and
    those are not the rollout's."""
    from torch._dynamo.utils import counters

    compiled: list[int] = []
    rollout = LP.rollout

    def counted(*a, **k):
        before = counters["stats"]["unique_graphs"]
        out = rollout(*a, **k)
        compiled.append(counters["stats"]["unique_graphs"] - before)
        return out

    monkeypatch.setattr(LP, "rollout", counted)
    return compiled


def test_compiled_decode_is_not_recompiled_after_a_learner_update(policy, monkeypatch) -> None:
    """compile_decode (the CUDA default, forced on here): rollout -> learner update -> rollout with longer
    prompts compiles nothing new (the decode step and its bookkeeping are dynamo frames)."""
    import torch._dynamo

    import thinkcraft.llm.hf.cache as C

    cfg, model, tok = policy
    torch._dynamo.reset()  # a fresh count (and no recompile limit reached by other tests in this process)
    engine = HFEngine.from_model(model, tok, kv_cache="static", compile_decode=True)
    warned: list[str] = []
    monkeypatch.setattr(C.log, "warning", lambda msg, *a: warned.append(msg % a))
    compiled = _graphs_after_each_rollout(monkeypatch)
    torch.manual_seed(0)
    reserved, (kv0, kv1) = _rollout_update_rollout(cfg, model, tok, engine, [[11, 12], [18, 19]])
    if warned:
        pytest.skip(f"torch.compile cannot build here: {warned[0][:200]}")
    assert _would_have_grown(reserved), reserved
    assert compiled[0] >= 2, compiled  # the step and the bookkeeping were compiled in the first rollout
    assert compiled[1] == 0 and kv1 is kv0, compiled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-graph decode step and the free-memory budget need a GPU")
def test_cuda_rollout_after_a_learner_update_records_no_new_graphs(monkeypatch) -> None:
    """On a GPU, as `train llm-policy` runs it (bf16 base + LoRA, autocast, the compiled static step by
    default): the rollout after the first update compiles nothing new and keeps the cache."""
    import torch._dynamo

    cfg = LP.LLMPolicyConfig(model="random:tiny", finetune="lora", max_turns=3, lr=1e-2, device="cuda")
    model, tok = LP.load_policy(cfg, ["turn 0 of seed 3 more more Reply with a number."] * 20,
                                torch.device("cuda"), torch.bfloat16)
    torch._dynamo.reset()
    engine = LP.make_engine(model, tok, cfg)
    assert engine.compile_decode and engine.kv_cache == "static"
    compiled = _graphs_after_each_rollout(monkeypatch)
    torch.manual_seed(0)
    reserved, (kv0, kv1) = _rollout_update_rollout(cfg, model, tok, engine, [[11, 12], [18, 19]],
                                                   torch.device("cuda"), torch.bfloat16)
    assert compiled[0] >= 2 and compiled[1] == 0 and kv1 is kv0, (compiled, reserved)
