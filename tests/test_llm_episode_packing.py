"""Episode packing (learner.build_rows): an episode whose turns extend each other token for token is trained as
one row - its last turn, every turn's completion under its own advantage, behaviour log-probs and train mask -
and that is a pure re-layout: log-probs, loss and gradients equal the one-row-per-turn computation (GRPO, RLOO,
REINFORCE, A*-PO; LoRA and full fine-tuning; with and without KL; token-mean and seq-mean-token-mean, where each
turn stays its own sequence). Tiny random Qwen2 model in float64 on CPU, so "equal" is tight (`_assert_same`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llm_helpers import spread_lora_b, spread_weights
from thinkcraft.rl import llm_losses as L
from thinkcraft.train import llm_policy as LP

VOCAB = 61
CPU = torch.device("cpu")


def _turn(prompt, completion, logprobs=None, train_mask=None, reward=0.0):
    return LP.TurnRecord(obs="", prompt_ids=list(prompt), completion_ids=list(completion),
                         logprobs=list(logprobs if logprobs is not None else [-1.0] * len(completion)),
                         train_mask=list(train_mask if train_mask is not None else [1] * len(completion)), text="",
                         finish_reason="stop", reward=reward)


# ------------------------------------------------------------------------------------------------ layout


def test_build_rows_merges_turns_that_extend_each_other():
    """Episode A (2 turns, the second extends the first) -> one row; B's second turn rewrote a token of the
    history -> two rows; C is one turn. Every completion token keeps its turn's mask, old log-prob and
    advantage, at the position it has in its own row."""
    a0 = _turn([1, 2, 3], [7, 8], [-0.5, -0.25])
    a1 = _turn([1, 2, 3, 7, 8, 4, 5], [9, 9, 9], [-0.1, -0.2, -0.3], train_mask=[1, 0, 1])
    b0 = _turn([1, 2], [6])
    b1 = _turn([1, 3, 6, 4], [5, 5])  # token 1 differs from b0's: not an extension
    c0 = _turn([4, 4], [2])
    turns = [a0, a1, b0, b1, c0]
    adv = [1.0, 2.0, -1.0, -2.0, 0.5]
    rows = LP.build_rows(turns, adv, [0.1, 0.2, 0.3, 0.4, 0.5], pad_id=0, device=CPU)
    assert rows.input_ids.tolist() == [[1, 2, 3, 7, 8, 4, 5, 9, 9, 9], [1, 2, 6, 0, 0, 0, 0, 0, 0, 0],
                                       [1, 3, 6, 4, 5, 5, 0, 0, 0, 0], [4, 4, 2, 0, 0, 0, 0, 0, 0, 0]]
    assert rows.attention_mask.sum(1).tolist() == [10, 3, 6, 3]
    # row 0: a0's completion (tokens 3, 4) predicted at 2, 3; a1's (tokens 7, 8, 9) at 6, 7, 8 (8's forced)
    assert rows.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 1, 0, 1]
    assert rows.segments[0].tolist() == [-1, -1, 0, 0, -1, -1, 1, 1, 1]
    assert rows.old_logp[0].tolist() == pytest.approx([0, 0, -0.5, -0.25, 0, 0, -0.1, -0.2, -0.3])
    assert rows.advantages[0].tolist() == [0, 0, 1, 1, 0, 0, 2, 0, 2]  # 0 on the forced token
    assert rows.segments[1:, :6].tolist() == [[-1, 2, -1, -1, -1, -1], [-1, -1, -1, 3, 3, -1],
                                              [-1, 4, -1, -1, -1, -1]]
    assert rows.advantages[2].tolist()[3:5] == [-2.0, -2.0]
    assert rows.rewards.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])  # per turn
    assert rows.turns.starts.tolist() == [0, 2, 3, 4, 5] and rows.turns.turn_tokens == 5 + 10 + 3 + 6 + 3
    assert rows.turns.seqs_per_row().tolist() == [2, 1, 1, 1]
    assert rows.turns.metrics(22.0) == {"learner/episode_rows": 1.0, "learner/turn_rows": 3.0,
                                        "learner/tokens_saved_frac": pytest.approx(1 - 22 / 27)}
    flat = LP.build_rows(turns, adv, [0.0] * 5, pad_id=0, device=CPU, merge_episodes=False)
    assert flat.turns.starts.tolist() == [0, 1, 2, 3, 4, 5] and flat.input_ids.shape == (5, 10)
    assert flat.input_ids[1].tolist() == rows.input_ids[0].tolist()
    assert flat.loss_mask[0].tolist()[:4] == [0, 0, 1, 1] and flat.advantages[1].tolist()[6:9] == [2, 0, 2]


def test_a_turn_with_nothing_trained_is_no_sequence():
    """A turn whose every token was forced is not counted by seq-mean-token-mean (as its own row was not)."""
    turns = [_turn([1], [2, 3]), _turn([1, 2, 3, 4], [5], train_mask=[0]), _turn([1, 2, 3, 4, 5, 6], [7])]
    rows = LP.build_rows(turns, [1.0, 1.0, 1.0], [0.0] * 3, 0, CPU)
    assert rows.turns.starts.tolist() == [0, 3] and rows.turns.trained.tolist() == [True, False, True]
    assert rows.turns.seqs_per_row().tolist() == [2]


def test_every_token_of_the_prefix_is_compared():
    """Chains of random turns with one token of one earlier turn changed (any position, prompt or completion,
    or the history cut short) never merge across the change; untouched chains always do."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        prompt, turns = rng.integers(1, 50, 3).tolist(), []
        for _ in range(4):
            comp = rng.integers(1, 50, rng.integers(0, 4)).tolist()
            turns.append(_turn(prompt, comp))
            prompt = prompt + comp + rng.integers(1, 50, rng.integers(0, 3)).tolist()
        k = int(rng.integers(1, 4))  # turn k no longer extends turn k-1
        prev = turns[k - 1].prompt_ids + turns[k - 1].completion_ids
        p = list(turns[k].prompt_ids)
        if trial % 5 == 0:
            p = prev[:-1]  # shorter than the history it should repeat
        else:
            j = int(rng.integers(0, len(prev)))
            p[j] = 50 + (p[j] % 7)
        turns[k] = _turn(p, turns[k].completion_ids)
        rows = LP.build_rows(turns, [0.0] * 4, [0.0] * 4, 0, CPU)
        starts = rows.turns.starts.tolist()
        assert k in starts, (trial, k, starts)
        assert all(s in (0, k, 4) for s in starts) or k + 1 in starts  # the rest still merges


# ------------------------------------------------------------------------------------ update equality


def _model(finetune: str):
    torch.manual_seed(0)
    model = LP.random_model("tiny", vocab_size=VOCAB)
    spread_weights(model)
    model = LP.trainable(model, _cfg(finetune=finetune)).double()
    if finetune == "lora":
        spread_lora_b(model)
    return model.eval()


def _cfg(**kw):
    base = dict(model="random:tiny", finetune="lora", lr=1e-2, max_grad_norm=0.0, micro_batch_tokens=1 << 20)
    base.update(kw)
    return LP.LLMPolicyConfig(**base)


def _episodes(model, seed=0):
    """2 seeds x 2 samples of 1-4 turns, each prompt = the previous prompt + reply + a new observation; one
    episode's third turn rewrote its history (its turns 0-1 and 2-3 are two rows); some forced tokens; behaviour
    log-probs = the model's own + noise (ratios away from 1, some clipped)."""
    rng = np.random.default_rng(seed)
    episodes = []
    for i, n_turns in enumerate([3, 1, 4, 2]):
        e = LP.Trajectory(seed=i // 2, group=i // 2)
        prompt = rng.integers(3, VOCAB, 4).tolist()
        for k in range(n_turns):
            if i == 2 and k == 2:
                prompt = [prompt[0] + 1 if prompt[0] + 1 < VOCAB else 3] + prompt[1:]
            comp = rng.integers(3, VOCAB, int(rng.integers(2, 6))).tolist()
            ids = torch.tensor([prompt + comp])
            with torch.no_grad():
                lp = L.token_logprobs(model(input_ids=ids).logits, ids)[0, len(prompt) - 1:]
            old = (lp + torch.from_numpy(rng.normal(0, 0.3, len(comp)))).tolist()
            mask = [1] * len(comp)
            if (i + k) % 3 == 0:
                mask[-1] = 0
            e.turns.append(_turn(prompt, comp, old, mask, reward=float(rng.normal())))
            prompt = prompt + comp + rng.integers(3, VOCAB, int(rng.integers(1, 4))).tolist()
        episodes.append(e)
    return episodes


def _rows(episodes, algo, merge):
    scores, groups = LP.row_scores_and_groups(episodes, 0.9, 8)
    adv = L.ADVANTAGE_ESTIMATORS[algo](
        L.AdvantageInputs(torch.tensor(scores), torch.tensor(groups), torch.zeros(len(scores)), None),
        L.AdvantageOptions()).values
    turns = [t for e in episodes for t in e.turns]
    return LP.build_rows(turns, adv.tolist(), scores, 0, CPU, merge_episodes=merge)


def _update(learner, rows, v_star=None):
    learner.model.zero_grad(set_to_none=True)
    stats = learner.update(rows, v_star=v_star)
    return stats, {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}


def _assert_same(got, want):
    """Per parameter, |got - want| / |want| < 1e-6. Not 1e-12: transformers' RMSNorm computes in fp32 whatever
    the model's dtype, and a token of an episode's history gets its gradient summed over the later turns before
    the norm's backward in the merged row, after it in the per-turn rows (a wrong advantage, mask or segment
    on one turn moves these by > 1e-2)."""
    assert set(got) == set(want) and any(g.abs().sum() > 0 for g in want.values())
    for n in want:
        err = float((got[n] - want[n]).norm() / want[n].norm().clamp(min=1e-30))
        assert err < 1e-6 or float(want[n].norm()) < 1e-12, f"{n}: relative error {err:.2e}"


def test_merged_rows_give_each_turns_own_logprobs():
    """The attention argument, checked: every completion token's log-prob read from its episode's row equals
    the one read from its own turn's row."""
    model = _model("lora")
    episodes = _episodes(model)
    learner = LP.Learner(_cfg(), model, None, CPU, None)
    got = {}
    with torch.no_grad():
        for merge in (True, False):
            rows = _rows(episodes, "grpo", merge)
            (mb,) = learner.plan(rows)
            lp = learner.logprobs(rows, mb)
            sel = rows.loss_mask > 0
            order = torch.argsort(rows.segments[sel] * 10_000 + torch.nonzero(sel)[:, 1], stable=True)
            got[merge] = lp[sel][order]
    assert got[True].numel() == got[False].numel() > 20
    torch.testing.assert_close(got[True], got[False], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("algo,finetune,agg,kl,budget,offpolicy", [
    ("grpo", "lora", "seq-mean-token-mean", 0.0, 1 << 20, "none"),
    ("grpo", "full", "token-mean", 0.1, 24, "none"),
    ("rloo", "lora", "token-mean", 0.0, 24, "none"),
    ("rloo", "full", "seq-mean-token-mean", 0.1, 1 << 20, "none"),
    ("reinforce", "lora", "seq-mean-token-mean", 0.1, 24, "none"),
    ("reinforce", "full", "token-mean", 0.0, 1 << 20, "none"),
    # the async loop's off-policy corrections (rl.llm_losses), in the same micro-batch loss path
    ("grpo", "lora", "seq-mean-token-mean", 0.1, 24, "decoupled"),
    ("rloo", "full", "token-mean", 0.0, 24, "tis"),
])
def test_episode_rows_update_equals_the_per_turn_update(algo, finetune, agg, kl, budget, offpolicy):
    """Loss and gradients of the update on episode rows equal those on one row per turn (several micro-batches
    at budget 24), and the metrics count the rows and the tokens saved. With an off-policy correction the
    per-token behaviour weights follow their tokens into either layout (and change the gradient)."""
    model = _model(finetune)
    episodes = _episodes(model, seed=1)
    cfg = dict(algo=algo, finetune=finetune, loss_agg=agg, kl_coef=kl, micro_batch_tokens=budget,
               logit_chunk_mib=0.0001)
    learner = LP.Learner(_cfg(**cfg, offpolicy=offpolicy, offpolicy_cap=1.2), model, None, CPU, None)
    learner.optimizer.step = lambda: None  # keep the weights: compare gradients
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from the reference (full fine-tuning's frozen copy is the initial weights)
        for p in learner.params:
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02)
    want_stats, want = _update(learner, _rows(episodes, algo, merge=False))
    stats, got = _update(learner, _rows(episodes, algo, merge=True))
    _assert_same(got, want)
    assert stats["losses/loss"] == pytest.approx(want_stats["losses/loss"], rel=1e-9, abs=1e-12)
    if kl:
        assert stats["losses/kl"] == pytest.approx(want_stats["losses/kl"], rel=1e-9, abs=1e-12)
        assert stats["losses/kl"] > 0  # (full: the frozen copy; LoRA: the adapter off)
    if agg == "token-mean":  # token means are per micro-batch token shares in either layout
        assert stats["losses/clip_frac"] == pytest.approx(want_stats["losses/clip_frac"], rel=1e-9)
    if offpolicy == "none":
        assert 0.0 < want_stats["losses/clip_frac"] < 1.0
        assert not any(k.startswith("offpolicy/") for k in stats)
    else:  # the ratio is to the proximal policy (this forward): 1, unclipped; the weights carry the mismatch
        assert want_stats["losses/clip_frac"] == 0.0
        assert 0.0 < want_stats["offpolicy/capped_frac"] < 1.0 and want_stats["offpolicy/weight_mean"] != 1.0
        if agg == "token-mean":
            for k in ("offpolicy/capped_frac", "offpolicy/weight_mean"):
                assert stats[k] == pytest.approx(want_stats[k], rel=1e-9)
        plain = LP.Learner(_cfg(**cfg), learner.model, None, CPU, None)
        plain.ref_model = learner.ref_model
        _, uncorrected = _update(plain, _rows(episodes, algo, merge=True))
        assert any(float((uncorrected[n] - got[n]).norm()) > 1e-3 * float(got[n].norm()) for n in got)
    turn_tokens = sum(len(t.prompt_ids) + len(t.completion_ids) for e in episodes for t in e.turns)
    last_tokens = 0
    for e in episodes:  # episode 2 is two rows (turns 0-1, 2-3)
        ends = [1, 3] if e is episodes[2] else [len(e.turns) - 1]
        last_tokens += sum(len(e.turns[k].prompt_ids) + len(e.turns[k].completion_ids) for k in ends)
    assert want_stats["learner/tokens"] == turn_tokens and want_stats["learner/tokens_saved_frac"] == 0.0
    assert want_stats["learner/episode_rows"] == 0 and want_stats["learner/turn_rows"] == 10
    assert stats["learner/tokens"] == last_tokens
    assert stats["learner/tokens_saved_frac"] == pytest.approx(1 - last_tokens / turn_tokens)
    assert (stats["learner/episode_rows"], stats["learner/turn_rows"]) == (4, 1)


def test_padded_layout_equals_too():
    """The same re-layout through padded micro-batches (where no varlen kernel runs)."""
    model = _model("lora")
    episodes = _episodes(model, seed=2)
    learner = LP.Learner(_cfg(pack=False, micro_batch_tokens=40, kl_coef=0.1), model, None, CPU, None)
    learner.optimizer.step = lambda: None
    assert not learner.packed
    _, want = _update(learner, _rows(episodes, "grpo", merge=False))
    stats, got = _update(learner, _rows(episodes, "grpo", merge=True))
    _assert_same(got, want)
    assert stats["learner/packed"] == 0.0 and stats["learner/episode_rows"] == 4


@pytest.mark.parametrize("multi_turn,offpolicy", [(False, "none"), (True, "none"), (True, "tis")])
def test_apo_update_equals_the_per_turn_update(multi_turn, offpolicy):
    """A*-PO is single-turn: its rows are the turns either way. Its per-turn sequence log-prob sums are segment
    sums, so a merged multi-turn batch would regress each turn's own log-ratio all the same (and weigh it by
    its own sequence-level behaviour weight, off-policy)."""
    model = _model("lora")
    episodes = _episodes(model, seed=3)
    if not multi_turn:
        episodes = [LP.Trajectory(e.seed, e.group, e.sample, e.turns[:1]) for e in episodes]
    n = sum(len(e.turns) for e in episodes)
    v_star = torch.linspace(-0.5, 0.5, n, dtype=torch.float32)
    learner = LP.Learner(_cfg(algo="apo", env="arith", micro_batch_tokens=30, offpolicy=offpolicy,
                              offpolicy_cap=1.5), model, None, CPU, None)
    learner.optimizer.step = lambda: None
    want_stats, want = _update(learner, _rows(episodes, "reinforce", merge=False), v_star)
    merged = _rows(episodes, "reinforce", merge=True)
    assert (merged.input_ids.shape[0] < n) == multi_turn
    stats, got = _update(learner, merged, v_star)
    _assert_same(got, want)
    assert stats["losses/loss"] == pytest.approx(want_stats["losses/loss"], rel=1e-9)
    assert (want_stats.get("offpolicy/capped_frac", 0.0) > 0) == (offpolicy == "tis")  # some turns truncated


# ------------------------------------------------------------------------------------------- aggregation


def test_segment_aggregation_equals_rows_of_their_own():
    """seq-mean-token-mean over segments of shared rows equals it over the segments as rows; token-mean and
    sequence_logprob alike."""
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(3, 6, generator=g), (torch.rand(3, 6, generator=g) > 0.3).double().float()
    # row 0: segments 0 (cols 0-2) and 1 (3-5); row 1: segment 2; row 2: segments 3, 4 (col 5: no segment)
    seg = torch.tensor([[0, 0, 0, 1, 1, 1], [2, 2, 2, 2, 2, 2], [3, 3, 4, 4, 4, 0]])
    mask[2, 5] = 0
    spans = [(0, 0, 3), (0, 3, 6), (1, 0, 6), (2, 0, 2), (2, 2, 5)]
    own_x, own_m = torch.zeros(5, 6), torch.zeros(5, 6)
    for s, (r, a, b) in enumerate(spans):
        own_x[s, a:b], own_m[s, a:b] = x[r, a:b], mask[r, a:b]
    for how in ("token-mean", "seq-mean-token-mean"):
        torch.testing.assert_close(L.aggregate(x, mask, how, seg, 5), L.aggregate(own_x, own_m, how))
    torch.testing.assert_close(L.sequence_logprob(x, mask, seg, 5), L.sequence_logprob(own_x, own_m))
    empty = torch.zeros_like(mask)  # no tokens at all: 0, never NaN
    assert float(L.aggregate(x, empty, "seq-mean-token-mean", seg, 5)) == 0.0
