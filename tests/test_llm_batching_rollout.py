"""The llm-policy rollout on a continuous-batching engine (CPU, tiny random model): episodes step their env as
soon as their own turn is back (subset env steps), prompts only grow and the engine reuses each episode's KV,
a chat template that rewrites earlier turns is detected and counted, and the per-row sampler draws from the
tempered top-p distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from thinkcraft.envs.textenvs import ArithTask, StepResult
from thinkcraft.llm.hf.rows import sample_rows, token_logprobs, top_p_filter
from thinkcraft.llm.protocol import SamplingParams
from thinkcraft.train import llm_policy as LP


class TurnsEnv:
    """A 3-turn env whose observations differ per episode; records how it was stepped."""

    name = "turns"
    system_prompt = "Reply with a number."
    max_turns = 3

    def reset(self, seeds):
        self.t = [0] * len(seeds)
        self.done = [False] * len(seeds)
        self.calls: list[list[int] | None] = []
        return [f"turn 0 of seed {s}" for s in seeds]

    def active_indices(self):
        return [i for i, d in enumerate(self.done) if not d]

    def step(self, actions, indices=None):
        self.calls.append(None if indices is None else list(indices))
        active = self.active_indices() if indices is None else list(indices)
        obs = []
        for i in active:
            self.t[i] += 1
            self.done[i] = self.t[i] >= 3
            obs.append("" if self.done[i] else f"turn {self.t[i]}" + " more" * i)
        n = len(active)
        return StepResult(obs, np.ones(n, np.float32), np.array([self.done[i] for i in active]), np.zeros(n, bool),
                          [{} for _ in range(n)])

    def counters(self):
        return {}


@pytest.fixture(scope="module")
def policy():
    cfg = LP.LLMPolicyConfig(model="random:tiny", finetune="lora")
    texts = [ArithTask(1).problem(s).question for s in range(100)] + ["turn 0 of seed 3 more Reply with a number."] * 20
    model, tok = LP.load_policy(cfg, texts, torch.device("cpu"), torch.float32)
    return cfg, model, tok


@pytest.mark.parametrize("submit_chunk,record_chunk", [(64, 16), (2, 1)])
def test_episodes_move_on_independently_with_turn_kv_reuse(policy, submit_chunk: int, record_chunk: int,
                                                           monkeypatch) -> None:
    """(submit_chunk 2: next prompts are submitted two at a time, the engine prefilling each chunk in between -
    stepping it where other episodes are decoding; record_chunk 1: one turn record built after each engine step, so
    records are still waiting when the next env step comes.)"""
    import importlib

    from thinkcraft.utils.timing import PhaseTimer

    module = importlib.import_module("thinkcraft.train.llm_policy.rollout")
    monkeypatch.setattr(module, "SUBMIT_CHUNK", submit_chunk)
    monkeypatch.setattr(module, "RECORD_CHUNK", record_chunk)
    cfg, model, tok = policy
    engine = LP.make_engine(model, tok, cfg)
    assert engine.capabilities.continuous_batching and engine.compile_decode is False  # CPU: the eager step
    # many "end of sequence" tokens: completions of very different lengths, so turns finish at different steps
    engine.eos_ids = set(range(0, len(tok), 5))
    env, metrics, timer = TurnsEnv(), {}, PhaseTimer()
    torch.manual_seed(0)
    eps = LP.rollout(env, engine, tok, seeds=[3, 4, 5], samples_per_seed=2, sampling=SamplingParams(max_new_tokens=12),
                     history_turns=-1, metrics=metrics, env_batch_frac=0.0, timer=timer)
    assert all(len(e.turns) == 3 and e.terminated for e in eps)
    for e in eps:  # each turn's record holds that turn's observation and env verdict, in the order played
        assert [t.obs for t in e.turns] == [f"turn 0 of seed {e.seed}"] + [
            f"turn {k}" + " more" * eps.index(e) for k in (1, 2)]
        assert [t.reward for t in e.turns] == [1.0, 1.0, 1.0]
    t = timer.metrics()  # the rollout's wall time holds its phases; the records were built between engine steps
    assert t["timing/records"] > 0
    assert t["timing/rollout"] >= t["timing/generate"] + t["timing/env"] + t["timing/records"]
    assert 0 < t["timing/prompts"] < t["timing/generate"]  # the next prompts' host work, timed inside generate
    assert any(c is not None for c in env.calls), "no episode stepped on its own"
    for e in eps:
        for a, b in zip(e.turns, e.turns[1:]):  # append-only: the next prompt extends prompt + reply tokens
            seen = a.prompt_ids + a.completion_ids
            assert b.prompt_ids[: len(seen)] == seen and not b.template_fallback
            assert b.reused_tokens == len(seen) - 1 and b.prefill_tokens == len(b.prompt_ids) - len(seen) + 1
        assert e.turns[0].reused_tokens > 0  # the system prompt: a shared prefix stored once
    assert metrics["kv/prefill_saved_frac"] > 0.5 and metrics["kv/template_fallbacks"] == 0
    assert 0 < metrics["kv/turn_reuse_saved_frac"] < metrics["kv/prefill_saved_frac"]
    assert metrics["kv/evictions"] == 0 and engine.pending() == 0
    assert metrics["engine/decode_step_ms"] > 0 and metrics["engine/host_length_ends"] == 0
    assert 0 <= metrics["engine/decode_wait_ms"] <= metrics["engine/decode_step_ms"]
    assert 1 <= metrics["engine/rows_per_decode_step"] <= 6  # six episodes, each row a running episode
    assert engine._batcher.table.parked((0, 0)) is None  # ended episodes released their KV
    turns = [t for e in eps for t in e.turns]  # the learner trains each episode as one row: its last turn
    rows = LP.build_rows(turns, [1.0] * len(turns), [0.0] * len(turns), tok.pad_token_id, torch.device("cpu"))
    assert rows.turns.starts.tolist() == [0, 3, 6, 9, 12, 15, 18]


def _lockstep_rollout(policy, monkeypatch, sampling) -> tuple[list, list, dict]:  # noqa: ANN001
    """A lockstep rollout of six episodes (every reply runs to max_new_tokens: the rows end together) with the
    engine's `admit` calls counted: (episodes, one entry an admit, the rollout's metrics)."""
    cfg, model, tok = policy
    engine = LP.make_engine(model, tok, cfg)
    engine.eos_ids = set()
    admits: list = []
    real = engine.admit
    monkeypatch.setattr(engine, "admit", lambda: admits.append(1) or real())
    metrics: dict = {}
    eps = LP.rollout(TurnsEnv(), engine, tok, seeds=[3, 4, 5], samples_per_seed=2, sampling=sampling, history_turns=-1,
                     metrics=metrics, env_batch_frac=1.0)
    return eps, admits, metrics


def test_prompts_in_chunks_keep_the_turn_in_lockstep(policy, monkeypatch) -> None:
    """A lockstep rollout (every episode's turn back before the env steps) whose prompts go in two at a time: each
    chunk is prefilled (`admit`) while the next is built, and every decode step holds all six rows - none a step
    ahead of the others, as a `step` between the chunks would put them (and the turns would come back apart)."""
    import importlib

    module = importlib.import_module("thinkcraft.train.llm_policy.rollout")
    monkeypatch.setattr(module, "SUBMIT_CHUNK", 2)
    eps, admits, metrics = _lockstep_rollout(policy, monkeypatch, SamplingParams(max_new_tokens=5))
    assert all(len(e.turns) == 3 for e in eps)
    assert metrics["engine/rows_per_decode_step"] == 6
    assert len(admits) == 2 * 2  # turns 2 and 3: three chunks of two, prefilled after the first two


def test_submit_bounds_a_short_first_chunk_then_full_ones(monkeypatch) -> None:
    """`submit_bounds`: chunks of SUBMIT_CHUNK covering every prompt once, the first SUBMIT_FIRST long where that is
    set and shorter than a chunk (and than the prompts)."""
    import importlib

    module = importlib.import_module("thinkcraft.train.llm_policy.rollout")
    monkeypatch.setattr(module, "SUBMIT_CHUNK", 128)
    monkeypatch.setattr(module, "SUBMIT_FIRST", 0)
    assert module.submit_bounds(256) == [(0, 128), (128, 256)] and module.submit_bounds(0) == []
    monkeypatch.setattr(module, "SUBMIT_FIRST", 16)
    assert module.submit_bounds(256) == [(0, 16), (16, 144), (144, 256)]
    assert module.submit_bounds(100) == [(0, 16), (16, 100)]
    assert module.submit_bounds(10) == [(0, 10)]  # fewer prompts than the first chunk: one
    monkeypatch.setattr(module, "SUBMIT_FIRST", 200)  # not shorter than a chunk: no first chunk of its own
    assert module.submit_bounds(256) == [(0, 128), (128, 256)]


def test_a_short_first_chunk_keeps_the_turn_in_lockstep(policy, monkeypatch) -> None:
    """SUBMIT_FIRST=1 with chunks of 4: each boundary's six prompts go as 1 + 4 + 1, the first two prefilled (`admit`)
    while the next is built, every decode step holding all six rows, and the same turns played as with one chunk."""
    import importlib

    module = importlib.import_module("thinkcraft.train.llm_policy.rollout")

    def played(first: int, chunk: int) -> tuple[list, int, float]:
        monkeypatch.setattr(module, "SUBMIT_FIRST", first)
        monkeypatch.setattr(module, "SUBMIT_CHUNK", chunk)
        torch.manual_seed(0)
        eps, admits, metrics = _lockstep_rollout(policy, monkeypatch, SamplingParams(max_new_tokens=5, temperature=0.0))
        return [[t.completion_ids for t in e.turns] for e in eps], len(admits), metrics["engine/rows_per_decode_step"]

    turns, admits, rows = played(1, 4)
    assert rows == 6 and admits == 2 * 2  # turns 2 and 3: chunks 1, 4 and 1, the first two prefilled apart
    assert played(0, 256)[0] == turns  # greedy: the same replies as the whole boundary in one chunk


def test_env_chunks_step_apart_and_play_the_same_lockstep_turns(policy, monkeypatch) -> None:
    """THINKCRAFT_ENV_CHUNKED=1 with chunks of two: each chunk of a boundary steps its own env call (indices of its
    episodes) before its prompts are built and prefilled, the turn still decodes in lockstep (six rows a step), and
    the greedy episodes are the very ones of the one-env-call boundary."""
    import importlib

    module = importlib.import_module("thinkcraft.train.llm_policy.rollout")
    monkeypatch.setattr(module, "SUBMIT_CHUNK", 2)
    cfg, model, tok = policy
    played = {}
    for chunked in ("0", "1"):
        monkeypatch.setenv("THINKCRAFT_ENV_CHUNKED", chunked)
        engine = LP.make_engine(model, tok, cfg)
        engine.eos_ids = set()  # every reply runs to max_new_tokens: the rows end together
        admits = []
        real = engine.admit
        monkeypatch.setattr(engine, "admit", lambda: admits.append(1) or real())
        env, metrics = TurnsEnv(), {}
        eps = LP.rollout(env, engine, tok, seeds=[3, 4, 5], samples_per_seed=2,
                         sampling=SamplingParams(max_new_tokens=5, temperature=0.0), history_turns=-1,
                         metrics=metrics, env_batch_frac=1.0)
        assert metrics["engine/rows_per_decode_step"] == 6 and len(admits) == 2 * 2
        played[chunked] = [[(t.obs, t.prompt_ids, t.completion_ids, t.reward) for t in e.turns] for e in eps]
        # three turns: the unchunked boundary one call of all six; the chunked one a call per pair (the last pair of
        # the last turn is all that is still active: the plain call)
        want = [None] * 3 if chunked == "0" else [[0, 1], [2, 3], [4, 5]] * 2 + [[0, 1], [2, 3], None]
        assert env.calls == want
    assert played["0"] == played["1"] and all(len(e) == 3 for e in played["1"])


def test_a_template_that_rewrites_earlier_turns_is_counted(policy) -> None:
    cfg, model, tok = policy
    import copy

    tok2 = copy.deepcopy(tok)
    # like Qwen3 dropping earlier thoughts: earlier assistant turns are rendered shortened
    tok2.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'][:2] }}{% else %}{{ m['content'] }}"
        "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    engine = LP.make_engine(model, tok2, cfg)
    metrics: dict = {}
    eps = LP.rollout(TurnsEnv(), engine, tok2, seeds=[3], samples_per_seed=2,
                     sampling=SamplingParams(max_new_tokens=6, temperature=0.0), history_turns=-1, metrics=metrics)
    fell_back = [t.template_fallback for e in eps for t in e.turns]
    # turn 0 has nothing before it; every later turn follows a reply the template shortens (unless the reply
    # was already at most 2 characters: then the rendering still extends the previous prompt)
    expect = [k > 0 and len(e.turns[k - 1].text) > 2 for e in eps for k in range(3)]
    assert fell_back == expect and any(expect)
    assert metrics["kv/template_fallbacks"] == sum(expect)
    turns = [t for e in eps for t in e.turns]  # the learner starts a new row at each rewritten turn
    rows = LP.build_rows(turns, [1.0] * len(turns), [0.0] * len(turns), tok2.pad_token_id, torch.device("cpu"))
    assert rows.turns.starts.tolist() == [k for k in range(len(turns) + 1) if k % 3 == 0 or (k < 6 and expect[k])]
    # the prompt the model saw is the template's own rendering, tokenized whole
    t = eps[0].turns[2]
    assert tok2.decode(t.prompt_ids) == tok2.apply_chat_template(
        [{"role": "system", "content": "Reply with a number."}, {"role": "user", "content": t.obs}][:1]
        + [m for k, turn in enumerate(eps[0].turns[:2]) for m in (
            {"role": "user", "content": turn.obs}, {"role": "assistant", "content": turn.text})]
        + [{"role": "user", "content": t.obs}], tokenize=False, add_generation_prompt=True)


def test_per_row_sampling_draws_the_tempered_top_p_distribution() -> None:
    torch.manual_seed(0)
    base = torch.randn(3, 6) * 2
    temp, top_p, n = torch.tensor([1.0, 0.7, 0.0]), torch.tensor([1.0, 0.8, 1.0]), 40000
    toks = sample_rows(base.repeat_interleave(n, 0), temp.repeat_interleave(n), top_p.repeat_interleave(n), True, True,
                       torch.Generator().manual_seed(1)).view(3, n)
    emp = torch.stack([torch.bincount(toks[r], minlength=6) for r in range(3)]).float() / n
    want = torch.softmax(top_p_filter(base[:2] / temp[:2, None], torch.tensor([[2.0], [0.8]])), -1)
    torch.testing.assert_close(emp[:2], want, atol=0.01, rtol=0)
    assert (toks[2] == base[2].argmax()).all()  # temperature 0: greedy


def test_token_logprobs_equal_the_log_softmax_at_the_token() -> None:
    """The decode step's behaviour log-probs (logit less logsumexp, no (S, V) log-softmax written): equal to
    log_softmax(...).gather(...) for large, small and masked (-inf) logits, in float32 and from bf16 logits."""
    torch.manual_seed(0)
    logits = torch.randn(5, 1000) * torch.tensor([1.0, 10.0, 50.0, 0.01, 3.0])[:, None]
    logits[4, ::3] = float("-inf")  # a grammar's mask: the sampled token is never a masked one
    tokens = torch.tensor([3, 999, 0, 500, 1])
    want = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    got = token_logprobs(logits, tokens)
    assert got.shape == (5,) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    half = logits.bfloat16().float()
    torch.testing.assert_close(token_logprobs(half, tokens),
                               torch.log_softmax(half, -1).gather(1, tokens[:, None]).squeeze(1), atol=1e-5, rtol=1e-6)


@pytest.mark.slow
def test_bench_quick_writes_the_documented_rows(tmp_path) -> None:
    """bench/llm_policy_craftax.py --quick runs end to end on the CPU (Craftax-Classic, tiny shape) and writes
    the issue's row fields, so that the GPU run is not where it gets debugged."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_llm_policy_craftax", root / "bench" / "llm_policy_craftax.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "rows.json"
    assert mod.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["thinking_budget"] for r in rows] == [0, 6]
    for r in rows:
        assert {"model_shape", "num_envs", "max_new_tokens", "thinking_budget", "decisions_per_s",
                "rollout_decisions_per_s", "generate_tok_per_s", "generate_share", "prefill_tokens_saved_frac",
                "peak_learner_gb", "learner_tokens_per_s", "card", "date"} <= set(r)
        assert r["decisions_per_s"] > 0 and r["rollout_decisions_per_s"] >= r["decisions_per_s"]
        assert r["learner_tokens_per_s"] > 0 and r["learner_packed"]  # the learner packs on CPU too
        assert r["prefill_tokens_saved_frac"] > 0.5  # the system prompt and every earlier turn are reused
        # each 2-turn episode is one learner row: its first turn's tokens are not trained on twice
        assert r["learner_episode_rows"] == 4 and r["learner_turn_rows"] == 0
        assert 0.25 < r["learner_tokens_saved_frac"] < 0.5 and r["learner_tokens"] > 0
        assert r["lora_merged_layers"] == 0  # a CPU engine does not merge (lora_fast.merge_default): rows say which served
        assert r["lora_fast_train_layers"] == r["lora_fast_layers"]  # the learner's cast-free path: on by default
        assert r["fused_rmsnorms"] > 0  # swapped in (on the CPU's fp32 learner each call keeps HF's forward)
        # the per-step record and the rates over the steps that captured no graph (the CPU captures none)
        assert len(r["rollout_s_by_step"]) == len(r["graph_captures_by_step"]) == r["steps_measured"] + 1
        assert r["steps_settled"] == r["steps_measured"] and r["rollout_decisions_per_s_settled"] > 0
    assert rows[1]["thinking_tokens_mean"] > 0  # the thinking rows think (and are cut at the budget)
