"""llm-policy `--action-format json`: answers constrained to a JSON schema (xgrammar), the grammar after the
thought, and a learner whose log-probs are those of the constrained distribution the engine sampled from.

A random-weight model never writes JSON by itself: every answer that parses here parses because of the
constraint, and the engine's reported log-probs differ from the model's own wherever the grammar cut tokens
away - so the learner matching them means it recomputed the same allowed sets. With --pack-episodes an
episode's turns are one learner row; the allowed sets follow each turn's completion into it (same log-probs, loss
and gradients as one row per turn)."""

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from thinkcraft.envs.textenvs import ArithTask, RuleReward, StepResult, make_text_env
from thinkcraft.envs.textenvs.jsonformat import (
    action_instructions, action_schema, answer_as_hash_line, max_answer_tokens, parse_action_json, parse_answer,
)
from thinkcraft.llm.protocol import SamplingParams
from thinkcraft.rl.chunked_logprobs import AllowedTokens, full_linear_token_logprobs, linear_token_logprobs
from thinkcraft.train import llm_policy as LP
from thinkcraft.utils.errors import ConfigError

xgr = pytest.importorskip("xgrammar")

MOVES = ("left", "right", "noop")
REASON = 6
BUDGET = 4
MAX_NEW = BUDGET + 11 + max_answer_tokens(MOVES, REASON)


class JsonMoves:
    """A 2-turn env whose turns answer {"reason": ..., "action": one of MOVES} (the json format, no Craftax)."""

    name = "moves"
    max_turns = 2

    def __init__(self) -> None:
        self.answer_schema = action_schema(MOVES, REASON)
        self.system_prompt = "Move. " + action_instructions(REASON)

    def reset(self, seeds):
        self.t = [0] * len(seeds)
        return [f"you stand at {s}" for s in seeds]

    def active_indices(self):
        return [i for i, t in enumerate(self.t) if t < 2]

    def step(self, actions, indices=None):
        active = self.active_indices() if indices is None else list(indices)
        infos = []
        for i, a in zip(active, actions):
            self.t[i] += 1
            infos.append({"invalid": parse_action_json(a, MOVES) is None})
        end = np.array([self.t[i] >= 2 for i in active])
        n = len(active)
        return StepResult(["" if e else "next" for e in end], np.zeros(n, np.float32), end, np.zeros(n, bool), infos)

    def counters(self):
        return {}


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """(M, V) bool -> (M, ceil(V/32)) int32 bitmask (xgrammar's layout), the slow obvious way."""
    m, v = allowed.shape
    w = (v + 31) // 32
    bits = torch.zeros(m, w * 32, dtype=torch.int64)
    bits[:, :v] = allowed.long()
    words = (bits.view(m, w, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# ------------------------------------------------------------------------------------------- formats

def test_json_answers_parse_and_grade():
    assert parse_answer('<think>hmm {"x": 1}</think>\n\n{"reason": "r", "action": "do"}', "action") == ("do", "r")
    assert parse_action_json('{"action": "right"}', MOVES) == 1
    for bad in ('{"action": "jump"}', '{"action": "left"} extra', 'Action: left', '{"action": "le', '[1]', ''):
        assert parse_action_json(bad, MOVES) is None, bad
    assert answer_as_hash_line('{"reason": "2 + 3 = 5", "answer": 5}') == "2 + 3 = 5\n#### 5"
    assert answer_as_hash_line('{"answer": true}') == "" and answer_as_hash_line("#### 5") == ""
    env = make_text_env("arith", reward_fn=RuleReward(format_weight=0.1), action_format="json", reason_chars=8)
    assert env.answer_schema["properties"]["answer"]["type"] == "integer" and '"answer"' in env.system_prompt
    env.reset([0, 1, 2])
    gold = int(env.problems[0].answer)
    res = env.step([json.dumps({"reason": "x", "answer": gold}), '{"reason": "x", "answer": 99999}', f"#### {gold}"])
    assert res.rewards.tolist() == pytest.approx([1.1, 0.1, 0.0])  # the free format is no JSON answer
    assert [i["invalid"] for i in res.infos] == [False, False, True] and env.counters()["format/invalid"] == 1


def test_schema_keeps_the_reason_first_and_bounded():
    from xgrammar.testing import _is_grammar_accept_string

    schema = action_schema(MOVES, 5)
    assert list(schema["properties"]) == ["reason", "action"]
    g = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
    ok = ['{"reason": "a b!", "action": "left"}', '{"reason": "", "action": "noop"}']
    bad = ['{"action": "left", "reason": "a"}', '{"reason": "abcdef", "action": "left"}',
           '{"reason": "<think>", "action": "left"}', '{"reason": "a\\"", "action": "left"}']
    assert all(_is_grammar_accept_string(g, s) for s in ok) and not any(_is_grammar_accept_string(g, s) for s in bad)
    # the token bound: bytes of the longest answer + the stop token
    assert max_answer_tokens(MOVES, 5) == len('{"reason": "xxxxx", "action": "right"}') + 1


@pytest.mark.parametrize("kw,field", [
    (dict(action_reason_chars=4), "action-reason-chars"),
    (dict(action_format="json", max_new_tokens=10), "max-new-tokens"),
    (dict(action_format="json", thinking_budget=40, max_new_tokens=60), "max-new-tokens"),
])
def test_config_rejects(tmp_path, kw, field):
    with pytest.raises(ConfigError, match=field):
        LP.LLMPolicyConfig(model="random:tiny", run_dir=str(tmp_path / "r"), **kw)


# --------------------------------------------------------------------------- masked chunked log-probs

def test_masked_chunked_logprobs_equal_the_reference_and_only_allowed_logits_get_gradient():
    from thinkcraft.llm.constrained import bitmask_to_bool, constrained_log_softmax

    torch.manual_seed(0)
    n, hid, v = 7, 5, 70  # a vocabulary that is not a multiple of 32
    allowed = torch.rand(3, v) < 0.3
    allowed[:, :3] = True
    bitmask = _pack(allowed)
    ref_bits = ((bitmask.long()[:, :, None] >> torch.arange(32)) & 1).reshape(3, -1)[:, :v].bool()
    assert torch.equal(bitmask_to_bool(bitmask, v), allowed) and torch.equal(ref_bits, allowed)
    index = torch.tensor([0, -1, 1, 2, -1, 0, 1])
    targets = torch.tensor([0, 50, 1, 2, 69, 1, 0])
    h0, w0, b0 = (torch.randn(n, hid, dtype=torch.float64), torch.randn(v, hid, dtype=torch.float64),
                  torch.randn(v, dtype=torch.float64))
    at = AllowedTokens(bitmask, index)
    outs, grads = [], []
    for fn in (lambda h, w, b: linear_token_logprobs(h, w, targets, b, 1.0, 2, None, at),
               lambda h, w, b: linear_token_logprobs(h, w, targets, b, 1.0, None, None, at),
               lambda h, w, b: full_linear_token_logprobs(h, w, targets, b, 1.0, None, at)):
        h, w, b = (x.clone().requires_grad_() for x in (h0, w0, b0))
        out = fn(h, w, b)
        out.sum().backward()
        outs.append(out.detach())
        grads.append((h.grad, w.grad, b.grad))
    rows = torch.where((index >= 0)[:, None], bitmask[index.clamp(min=0)], torch.full_like(bitmask[:1], -1))
    ref = constrained_log_softmax(h0 @ w0.T + b0, rows).gather(1, targets[:, None]).squeeze(1)
    for out, g in zip(outs, grads):
        assert torch.allclose(out, ref, atol=1e-12)
        for a, c in zip(g, grads[0]):
            assert torch.allclose(a, c, atol=1e-12)
    # one constrained row alone: d logp / d logits = onehot - masked softmax, exactly 0 off the allowed set
    h, w, b = h0[:1].clone(), w0.clone(), b0.clone().requires_grad_()
    linear_token_logprobs(h, w, targets[:1], b, 1.0, None, None, AllowedTokens(bitmask, index[:1])).sum().backward()
    assert (b.grad[~allowed[0]] == 0).all() and (b.grad[allowed[0]] != 0).all()
    p = torch.softmax((h0[:1] @ w0.T + b0).masked_fill(~allowed[:1], float("-inf")), -1)[0]
    assert torch.allclose(b.grad, torch.nn.functional.one_hot(targets[:1], v)[0] - p, atol=1e-12)


# ------------------------------------------------------------------------------- engine and learner

@pytest.fixture(scope="module")
def policy():
    cfg = LP.LLMPolicyConfig(model="random:tiny", thinking_budget=BUDGET, max_new_tokens=MAX_NEW,
                             action_format="json", micro_batch_size=3, max_grad_norm=0.0)
    texts = [ArithTask(1).problem(s).question for s in range(100)] + [JsonMoves().system_prompt] * 5
    model, tok = LP.load_policy(cfg, texts, torch.device("cpu"), torch.float32)
    return cfg, model, tok


def _rollout(policy, tok=None, seeds=(1, 2), budget=BUDGET, metrics=None):
    cfg, model, tok0 = policy
    tok = tok or tok0
    engine = LP.make_engine(model, tok, cfg)
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, thinking_budget=budget)
    return LP.rollout(JsonMoves(), engine, tok, seeds, 2, sampling, history_turns=-1, metrics=metrics), engine


def test_guide_waits_for_the_thought_to_close(policy):
    from thinkcraft.llm.constrained import StructuredOutput, answer_start, compile_guide

    _, model, tok = policy
    spec = StructuredOutput.from_schema(action_schema(MOVES, 0), "constrained")
    guide = compile_guide(tok, model.config.vocab_size, [tok.eos_token_id], spec)
    st = guide.start(2, "cpu", "constrained")
    st.close_row(1)
    st.open_row(0, after_thought=True)
    any_tok = torch.tensor([5, 5])
    assert (st.fill_mask()[0] == -1).all()  # thinking: every token allowed
    st.advance(any_tok, torch.tensor([False, True]))
    assert (st.fill_mask()[0] == -1).all() and not st.live[0]
    st.advance(any_tok, torch.tensor([True, True]))  # the thought closed with this token: not an answer token
    first = xgr.allocate_token_bitmask(1, guide.vocab_size)
    xgr.GrammarMatcher(guide.compiled).fill_next_token_bitmask(first)
    mask = st.fill_mask()  # the pending tokens are taken (the thought's last one by no matcher) before the mask
    assert st.live[0] and torch.equal(mask[0], first[0]) and st.rejected == 0
    # the replay's rule: after a sampled close tag, or after the last forced token of the close sequence
    think, close = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    assert answer_start([1, think], [7, close, 8, 9], [0, 0, 0, 0], think, close) == 2
    assert answer_start([1, think], [7, 3, close, 3, 8], [0, 1, 1, 1, 0], think, close) == 4
    assert answer_start([1, think, 2, close], [8, 9], [0, 0], think, close) == 0
    assert answer_start([1, think], [7, 8], [0, 0], think, close) == 2


def test_learner_logprobs_equal_the_engines_constrained_ones(policy):
    """The bit-close check: for the same weights the learner's log-probs of every trained token (free thought
    and constrained answer) equal what the engine reported, the ratio is 1 at the behaviour policy, and without
    the masks they would not be."""
    from thinkcraft.llm.constrained import answer_start

    cfg, model, tok = policy
    eps, engine = _rollout(policy)
    turns = [t for e in eps for t in e.turns]
    think, close = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    for t in turns:
        s = answer_start(t.prompt_ids, t.completion_ids, [m == 0 for m in t.train_mask], think, close)
        assert 0 < s < len(t.completion_ids) and close in t.completion_ids[:s] and t.thinking_tokens > 0
        assert parse_action_json(tok.decode(t.completion_ids[s:], skip_special_tokens=True), MOVES) is not None
        assert not t.invalid and t.structured is not None and t.structured.logprobs == "constrained"
    from thinkcraft.llm.hf.decode import eos_ids_of

    assert eos_ids_of(model, tok) == engine.eos_ids  # the replay's stop tokens are the engine's
    masks = LP.Learner(cfg, model, tok, torch.device("cpu"), None).allowed_tokens(turns)
    rows = LP.build_rows(turns, [1.0, -1.0] * (len(turns) // 2), [0.0] * len(turns), tok.pad_token_id,
                         torch.device("cpu"), masks=masks)
    free = LP.build_rows(turns, [0.0] * len(turns), [0.0] * len(turns), tok.pad_token_id, torch.device("cpu"))
    assert len(rows.allowed.bitmask) < sum(len(t.completion_ids) for t in turns)  # deduplicated allowed sets
    on = rows.loss_mask.bool()
    answer = on & (rows.allowed.index >= 0)
    assert answer.any() and (on & ~answer).any()  # constrained answers and free thoughts both trained
    for chunk_mib in (256.0, 0.0, 0.05):  # one chunk, the full logits, chunks of 6 rows
        learner = LP.Learner(LP.LLMPolicyConfig(**{**cfg.__dict__, "logit_chunk_mib": chunk_mib}), model, tok,
                             torch.device("cpu"), None)
        with torch.no_grad():
            for mb in learner.plan(rows):
                sl, m = slice(mb.start, mb.end), on[mb.start: mb.end, : mb.width - 1]
                lp = learner.logprobs(rows, mb)
                assert torch.allclose(lp[m], rows.old_logp[sl, : mb.width - 1][m], atol=2e-5, rtol=0)
                if chunk_mib == 0.0:
                    a = answer[sl, : mb.width - 1]
                    model_lp = learner.logprobs(free, mb)
                    assert (model_lp[a] - lp[a]).abs().max() > 1e-2  # the model's own distribution is another one
    learner.optimizer.step = lambda: None
    stats = learner.update(rows)
    assert stats["losses/ratio"] == pytest.approx(1.0, abs=1e-5) and stats["losses/clip_frac"] == 0.0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in learner.params)


def _all_logprobs(learner, rows):
    """(rows, longest - 1) learner log-probs over every micro-batch of `learner.plan` (0 where untrained)."""
    out = torch.zeros(rows.loss_mask.shape, dtype=torch.float64)
    with torch.no_grad():
        for mb in learner.plan(rows):
            out[mb.start: mb.end, : mb.width - 1] = learner.logprobs(rows, mb).double()
    return out


def _per_token(rows, x):
    """`x` at every completion token of the rows, in (turn, position) order: comparable across layouts."""
    col = torch.arange(rows.segments.shape[1]).expand_as(rows.segments)
    sel = rows.segments >= 0
    return x[sel][torch.argsort(rows.segments[sel] * 1_000_000 + col[sel], stable=True)]


@pytest.mark.parametrize("pack,chunk_mib,budget,kl", [(True, 256.0, 1 << 20, 0.0), (True, 0.05, 90, 0.1),
                                                      (False, 0.0, 90, 0.0), (False, 0.05, 1 << 20, 0.1)])
def test_episode_rows_keep_the_constrained_logprobs_and_update(policy, pack, chunk_mib, budget, kl):
    """--pack-episodes with --action-format json: a multi-turn episode of constrained answers trained as one
    row (its last turn) gives every token the log-prob it gets in its own turn's row - the grammar's allowed
    sets moved with the completions - and the same loss and gradients, packed (varlen) or padded, chunked or
    full logits, one micro-batch or several."""
    cfg, model, tok = policy
    eps, _ = _rollout(policy, seeds=(1, 2, 3))
    turns = [t for e in eps for t in e.turns]
    model = copy.deepcopy(model).double()  # float64: "the same" is tight
    lcfg = LP.LLMPolicyConfig(**{**cfg.__dict__, "pack": pack, "logit_chunk_mib": chunk_mib,
                                 "micro_batch_tokens": budget, "micro_batch_size": 0, "kl_coef": kl})
    learner = LP.Learner(lcfg, model, tok, torch.device("cpu"), None)
    assert learner.packed == pack
    learner.optimizer.step = lambda: None  # keep the weights: compare gradients
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # away from the behaviour policy (ratios off 1, some clipped) and from the reference
        for p in learner.params:
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    masks = learner.allowed_tokens(turns)
    adv = np.linspace(-1.0, 1.5, len(turns)).tolist()
    rows = {merge: LP.build_rows(turns, adv, [0.0] * len(turns), tok.pad_token_id, torch.device("cpu"),
                                 merge_episodes=merge, masks=masks) for merge in (True, False)}
    assert rows[False].input_ids.shape[0] == len(turns) == 2 * rows[True].input_ids.shape[0]  # 2-turn episodes
    # the allowed sets follow the tokens: the same set at every completion token in either layout, and constrained
    # tokens of both turns of an episode in its row
    want = torch.from_numpy(np.concatenate(masks.index))
    for r in rows.values():
        assert torch.equal(_per_token(r, r.allowed.index), want)
    assert ((rows[True].allowed.index >= 0).sum(1) == torch.tensor(
        [int((masks.index[2 * k] >= 0).sum() + (masks.index[2 * k + 1] >= 0).sum()) for k in range(len(eps))])).all()
    lps = {m: _per_token(r, _all_logprobs(learner, r)) for m, r in rows.items()}
    trained = _per_token(rows[True], rows[True].loss_mask) > 0
    assert trained.sum() > 20 and (want[trained] >= 0).any()
    torch.testing.assert_close(lps[True][trained], lps[False][trained], atol=1e-10, rtol=1e-9)
    stats, grads = {}, {}
    for m, r in rows.items():
        model.zero_grad(set_to_none=True)
        stats[m] = learner.update(r)
        grads[m] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert stats[False]["learner/micro_batches"] >= (2 if budget < 1000 else 1)
    assert stats[True]["losses/loss"] == pytest.approx(stats[False]["losses/loss"], rel=1e-8, abs=1e-12)
    assert 0.0 < stats[False]["losses/clip_frac"] < 1.0 and (stats[False]["losses/kl"] > 0) == (kl > 0)
    if kl:
        assert stats[True]["losses/kl"] == pytest.approx(stats[False]["losses/kl"], rel=1e-8)
    assert set(grads[True]) == set(grads[False]) and any(x.abs().sum() > 0 for x in grads[False].values())
    for n, want_g in grads[False].items():  # 1e-6, not 1e-12: RMSNorm runs in fp32 (test_llm_episode_packing)
        err = float((grads[True][n] - want_g).norm() / want_g.norm().clamp(min=1e-30))
        assert err < 1e-6 or float(want_g.norm()) < 1e-12, f"{n}: relative error {err:.2e}"
    # and the masks matter here: without them the merged row's log-probs are the model's own, not these
    free = dataclasses.replace(rows[True], allowed=None)
    own = _per_token(free, _all_logprobs(learner, free))
    assert ((own - lps[True])[trained & (want >= 0)].abs().max() > 1e-2)


def test_thought_opener_for_templates_that_do_not_open_the_thought(policy):
    """A chat template whose generation prompt does not open `<think>`: the rollout opens it (the grammar
    starts after the thought), and keeps it in the history so turns still extend each other."""
    tok = copy.deepcopy(policy[2])
    tok.chat_template = LP.CHATML_TEMPLATE
    metrics: dict = {}
    eps, _ = _rollout(policy, tok=tok, seeds=(3,), metrics=metrics)
    for e in eps:
        for t in e.turns:
            assert tok.decode(t.prompt_ids).endswith("<think>\n") and not t.invalid
    assert metrics["kv/template_fallbacks"] == 0 and metrics["thinking/tokens_mean"] > 0


@pytest.mark.slow
def test_llm_policy_json_actions_on_craftax_classic_end_to_end(tmp_path):
    """random:tiny on Craftax-Classic, JSON actions with a reason after a budgeted thought: zero invalid
    actions, and every update's ratio is 1 (the learner's constrained log-probs are the engine's), with each
    episode's turns trained as one row."""
    from thinkcraft.data.reader import read_table
    from thinkcraft.data.schema import table_to_records
    from thinkcraft.envs.text.names import ACTION_NAMES

    names = ACTION_NAMES["craftax-classic"]
    cfg = LP.LLMPolicyConfig(model="random:tiny", env="craftax-classic", action_format="json",
                             action_reason_chars=8, thinking_budget=BUDGET,
                             max_new_tokens=BUDGET + 11 + max_answer_tokens(names, 8), steps=2, prompts_per_step=2,
                             group_size=2, max_turns=2, micro_batch_size=4, run_dir=str(tmp_path / "run"),
                             plot=False, log_every_s=1e9, checkpoint_every=0)
    LP.run(cfg)
    recs = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    for r in recs:
        assert r["format/invalid_rate"] == 0.0 and r["losses/ratio"] == pytest.approx(1.0, abs=1e-4)
        assert r["learner/episode_rows"] > 0  # --pack-episodes (the default): constrained turns in episode rows
    records = table_to_records(read_table(Path(cfg.run_dir) / "trajectories"))
    acts = [t.act for rec in records for t in rec.turns]
    assert len(acts) == 2 * 2 * 2 * 2 and all(parse_action_json(a, names) is not None for a in acts)
