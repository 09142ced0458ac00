"""Hand-computed checks of the LLM-policy losses and advantage estimators."""

import math

import pytest
import torch

from thinkcraft.rl import llm_losses as L


def test_grpo_advantages_hand_computed():
    # group 0: rewards 1, 0, 0, 1 -> mean .5, population std .5 -> ±1
    # group 1: 2, 2 -> all equal -> 0
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    gid = torch.tensor([0, 0, 0, 0, 7, 7])
    adv = L.grpo_advantages(scores, gid, eps=0.0 + 1e-12)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0]), atol=1e-6)
    unscaled = L.grpo_advantages(scores, gid, scale_by_std=False)
    assert torch.allclose(unscaled, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0]))


def test_grpo_groups_need_not_be_contiguous():
    scores = torch.tensor([3.0, 10.0, 1.0, 20.0])
    gid = torch.tensor([1, 2, 1, 2])  # group 1: 3,1 (mean 2, std 1); group 2: 10,20 (mean 15, std 5)
    adv = L.grpo_advantages(scores, gid, eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]))


def test_rloo_advantages_hand_computed():
    # r = [1, 2, 6]: baselines are means of the others: 4, 3.5, 1.5
    scores = torch.tensor([1.0, 2.0, 6.0, 5.0])
    gid = torch.tensor([0, 0, 0, 1])  # a group of one gets 0
    adv = L.rloo_advantages(scores, gid)
    assert torch.allclose(adv, torch.tensor([-3.0, -1.5, 4.5, 0.0]))


def test_reinforce_baseline_and_running_mean():
    scores = torch.tensor([1.0, 3.0])
    assert torch.allclose(L.reinforce_advantages(scores, 1.5), torch.tensor([-0.5, 1.5]))
    b = L.update_running_baseline(None, scores, momentum=0.9)
    assert b == pytest.approx(2.0)
    b = L.update_running_baseline(b, torch.tensor([0.0, 0.0]), momentum=0.9)
    assert b == pytest.approx(1.8)


def test_discounted_returns():
    assert L.discounted_returns([1.0, 0.0, 2.0], gamma=0.5) == pytest.approx([1.5, 1.0, 2.0])
    assert L.discounted_returns([], 0.9) == []


def test_completion_mask_marks_only_generated_tokens():
    # row 0: prompt 2 tokens, 3 generated (total 5); row 1: prompt 3, 1 generated, padded to 6
    m = L.completion_mask(torch.tensor([2, 3]), torch.tensor([5, 4]), seq_len=6)
    # predicted positions t=0..4 predict tokens 1..5
    assert m.tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]]


def test_token_logprobs_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    ids = torch.randint(0, 5, (2, 4))
    got = L.token_logprobs(logits, ids)
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(got, ref, atol=1e-6)
    got_t = L.token_logprobs(logits, ids, temperature=2.0)
    ref_t = torch.log_softmax(logits[:, :-1] / 2, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(got_t, ref_t, atol=1e-6)


def test_k3_kl_hand_computed():
    logp = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.25)])
    # d = ref - logp = -ln2, 0 -> exp(d) - d - 1 = 0.5 + ln2 - 1, 0
    assert torch.allclose(L.k3_kl(logp, ref), torch.tensor([0.5 + math.log(2) - 1, 0.0]), atol=1e-6)


def test_clipped_pg_loss_hand_computed():
    logp = torch.log(torch.tensor([[1.5, 1.0, 0.5, 9.0]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # last token is padding: ignored
    s = L.clipped_pg_loss(logp, old, adv, mask, clip_eps=0.2, agg="token-mean")
    # ratios 1.5, 1, .5 -> min(ρA, clip(ρ)A): 1.2, 1, -0.8 (clip at 0.8 for negative advantage: min(-.5,-.8))
    assert s.loss.item() == pytest.approx(-(1.2 + 1.0 - 0.8) / 3)
    assert s.clip_frac.item() == pytest.approx(2 / 3)


def test_seq_mean_vs_token_mean_aggregation():
    x = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert L.aggregate(x, m, "token-mean").item() == pytest.approx(7 / 4)
    assert L.aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx((1 + 4) / 2)
    # a row without generated tokens does not count as a sequence
    m2 = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert L.aggregate(x, m2, "seq-mean-token-mean").item() == pytest.approx(1.0)


def test_pg_loss_gradient_is_reinforce_at_ratio_one():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    s = L.clipped_pg_loss(logp, logp.detach(), torch.tensor([[2.0, 2.0]]), torch.ones(1, 2), agg="token-mean")
    s.loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0]]))  # -A/num_tokens


def test_kl_penalty_added():
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    s = L.clipped_pg_loss(logp, logp, torch.zeros(1, 1), torch.ones(1, 1), ref_logp=ref, kl_coef=0.1)
    assert s.loss.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1), abs=1e-6)


def test_apo_value_hand_computed():
    r = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    v = L.apo_value(r, beta1=0.5)
    # 0.5 * log((e^0 + e^2)/2) and exactly 1 for equal rewards
    assert v[0].item() == pytest.approx(0.5 * math.log((1 + math.e**2) / 2))
    assert v[1].item() == pytest.approx(1.0)
    # limits: small β1 -> max, large β1 -> mean
    assert L.apo_value(r[:1], beta1=1e-3).item() == pytest.approx(1.0 - 1e-3 * math.log(2), abs=1e-6)
    assert L.apo_value(r[:1], beta1=1e4).item() == pytest.approx(0.5, abs=1e-3)


def test_apo_loss_hand_computed():
    seq_logp = torch.tensor([-10.0, -4.0])
    ref = torch.tensor([-12.0, -4.0])
    rewards = torch.tensor([1.0, 0.0])
    v = torch.tensor([0.5, 0.25])
    s = L.apo_loss(seq_logp, ref, rewards, v, beta2=0.1)
    # (0.1*2 - 0.5)^2 = 0.09 ; (0 - (-0.25))^2 = 0.0625
    assert s.loss.item() == pytest.approx((0.09 + 0.0625) / 2)


def test_broadcast_and_sequence_logprob():
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    tok = L.broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert tok.tolist() == [[0, 2, 2], [-1, 0, 0]]
    assert L.sequence_logprob(torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -5.0, -5.0]]), mask).tolist() == [-5.0, -1.0]


# --- the estimator table: one entry per --algo, one signature, hand-computed values ---------------------
_S = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 6.0])
_G = torch.tensor([0, 0, 0, 0, 3, 3])
_V = torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 1.0])
ESTIMATOR_CASES = [
    # algo, baseline in, options, advantages, baseline out
    ("grpo", None, L.AdvantageOptions(), [1.0, -1.0, -1.0, 1.0, -1.0, 1.0], None),
    ("grpo", None, L.AdvantageOptions(scale_by_std=False), [0.5, -0.5, -0.5, 0.5, -2.0, 2.0], None),
    ("rloo", None, L.AdvantageOptions(), [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, -4.0, 4.0], None),
    # first batch: its own mean (10/6) is the baseline; the running baseline starts there
    ("reinforce", None, L.AdvantageOptions(), [x - 10 / 6 for x in (1, 0, 0, 1, 2, 6)], 10 / 6),
    ("reinforce", 1.0, L.AdvantageOptions(baseline_momentum=0.5), [0.0, -1.0, -1.0, 0.0, 1.0, 5.0], 0.5 + 0.5 * 10 / 6),
    ("apo", None, L.AdvantageOptions(), [0.5, -0.5, -0.5, 0.5, 1.0, 5.0], None),
]


@pytest.mark.parametrize("algo,baseline,opts,expected,baseline_out", ESTIMATOR_CASES)
def test_advantage_estimator_table(algo, baseline, opts, expected, baseline_out):
    out = L.ADVANTAGE_ESTIMATORS[algo](L.AdvantageInputs(_S, _G, _V, baseline), opts)
    assert torch.allclose(out.values, torch.tensor(expected), atol=1e-3), out.values
    assert (out.baseline is None) == (baseline_out is None)
    if baseline_out is not None:
        assert out.baseline == pytest.approx(baseline_out)


def test_every_algo_has_an_estimator():
    from typing import get_args

    from thinkcraft.train.llm_policy.config import Algo

    assert set(L.ADVANTAGE_ESTIMATORS) == set(get_args(Algo))
