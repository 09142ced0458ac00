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


# --- chunked LM-head log-probs (rl.chunked_logprobs) ---------------------------------------------------------


def _head_case(n=11, h=8, v=37, bias=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, targets


@pytest.mark.parametrize("rows", [1, 3, 11, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_the_full_logits_values_and_gradients(rows, temperature):
    """Any chunking: the same values as `token_logprobs` over full logits, and the same gradients for the
    hidden states, the head's weight and its bias (a weighted sum as the loss, so every row's gradient differs)."""
    from thinkcraft.rl.chunked_logprobs import linear_token_logprobs

    hidden, weight, bias, targets = _head_case()
    coef = torch.linspace(-1.0, 2.0, hidden.shape[0], dtype=hidden.dtype)
    logits = (hidden @ weight.t() + bias)[None]
    ids = torch.cat([targets[:1], targets])[None]  # token_logprobs predicts ids[t+1] from position t
    want = L.token_logprobs(torch.cat([logits, logits[:, :1]], 1), ids, temperature)[0].double()
    want_grads = torch.autograd.grad((want * coef).sum(), (hidden, weight, bias))
    got = linear_token_logprobs(hidden, weight, targets, bias, temperature, rows_per_chunk=rows)
    got_grads = torch.autograd.grad((got.double() * coef).sum(), (hidden, weight, bias))
    assert got.dtype == torch.float64  # float64 inputs: the softmax in float64 too (fp32 from lower precisions)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_chunked_logprobs_gradcheck_and_frozen_head():
    """torch's numerical gradient check (float64), and a frozen head (LoRA: weight without grad) asks for
    no weight gradient."""
    from thinkcraft.rl.chunked_logprobs import full_linear_token_logprobs, linear_token_logprobs

    hidden, weight, bias, targets = _head_case(n=5, h=4, v=7)

    def f(h, w, b):
        return linear_token_logprobs(h, w, targets, b, 1.3, rows_per_chunk=2, compute_dtype=torch.float64)

    assert torch.autograd.gradcheck(f, (hidden, weight, bias), atol=1e-5)
    frozen = weight.detach()
    out = linear_token_logprobs(hidden, frozen, targets, None, rows_per_chunk=2)
    (g,) = torch.autograd.grad(out.sum(), hidden)
    (want,) = torch.autograd.grad(full_linear_token_logprobs(hidden, frozen, targets).sum(), hidden)
    torch.testing.assert_close(g, want.to(g.dtype), atol=1e-5, rtol=1e-5)


def test_chunked_logprobs_bf16_compute_matches_autocast_full_head():
    """With a bf16 compute dtype (the GPU path) the values stay those of a bf16 head with fp32 softmax."""
    from thinkcraft.rl.chunked_logprobs import full_linear_token_logprobs, linear_token_logprobs

    hidden, weight, _, targets = _head_case(n=9, h=16, v=50, bias=False, dtype=torch.float32)
    got = linear_token_logprobs(hidden, weight, targets, rows_per_chunk=4, compute_dtype=torch.bfloat16)
    want = full_linear_token_logprobs(hidden, weight, targets, compute_dtype=torch.bfloat16)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    g1 = torch.autograd.grad(got.sum(), (hidden, weight))
    g2 = torch.autograd.grad(want.sum(), (hidden, weight))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


def test_chunk_rows_bounds_the_logits_bytes():
    from thinkcraft.rl.chunked_logprobs import chunk_rows

    assert chunk_rows(151_936, 256) == 256 * 2**20 // (151_936 * 4) == 441
    assert chunk_rows(151_936, 0.001) == 1  # never zero rows
