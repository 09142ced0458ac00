"""Off-policy corrections (decoupled PPO, truncated IS) on hand-built batches with hand-computed values."""

import math

import pytest
import torch

from thinkcraft.rl import llm_losses as L

# one row, three generated tokens; the behaviour policy (the engine, a version behind) gave them
# log-probs behav; the learner's current (= proximal, one step per batch) log-probs are logp.
LOGP = [-1.0, -2.0, -0.5]
BEHAV = [-1.5, -1.0, -0.5]
W = [math.exp(0.5), math.exp(-1.0), 1.0]  # π_prox / π_behav per token: 1.6487, 0.3679, 1


def _batch(adv=1.0):
    logp = torch.tensor([LOGP], requires_grad=True)
    behav = torch.tensor([BEHAV])
    mask = torch.ones(1, 3)
    return logp, behav, L.broadcast_to_tokens(torch.tensor([adv]), mask), mask


@pytest.mark.parametrize("correction,cap,kept,weights", [
    ("decoupled", None, [1, 1, 1], W),  # no cap: every token, weighted by w
    ("decoupled", 1.5, [0, 1, 1], W),  # token 0 has w = 1.65 > 1.5: weight 0 (AReaL's cap), still counted
    ("tis", 1.5, [1, 1, 1], [1.5, W[1], 1.0]),  # truncated at C = 1.5, every token kept
])
def test_offpolicy_pg_loss_hand_computed(correction, cap, kept, weights):
    logp, behav, adv, mask = _batch(adv=1.0)
    st = L.offpolicy_pg_loss(logp, logp.detach(), behav, adv, mask, correction, cap=cap, agg="token-mean")
    # r = π_θ/π_prox = 1 at the step: per-token loss −w·A (0 where dropped); token-mean over all 3 tokens
    # (AReaL divides by the loss mask's count, dropped tokens included)
    n = 3
    expected = -sum(w * k for w, k in zip(weights, kept)) / n
    assert float(st.loss.detach()) == pytest.approx(expected, abs=1e-6)
    st.loss.backward()
    # d/dlogp_t of −w_t · r_t · A / n with dr/dlogp = r = 1  ->  −w_t · A / n on kept tokens, 0 elsewhere
    assert logp.grad[0].tolist() == pytest.approx([-w * k / n for w, k in zip(weights, kept)], abs=1e-6)
    assert float(st.weight_mean) == pytest.approx(sum(w * k for w, k in zip(weights, kept)) / n, abs=1e-6)
    assert float(st.capped_frac) == pytest.approx(0.0 if cap is None else 1 / 3, abs=1e-6)


def test_decoupled_clip_is_around_the_proximal_policy():
    # several steps on one batch: θ moved from prox by +0.5 on token 0 (r = e^0.5 = 1.65 > 1 + ε) with A > 0:
    # the clipped term −w·(1+ε)·A wins, and carries no gradient
    prox = torch.tensor([LOGP])
    logp = (prox + torch.tensor([[0.5, 0.0, 0.0]])).requires_grad_(True)
    behav = torch.tensor([BEHAV])
    mask = torch.ones(1, 3)
    adv = L.broadcast_to_tokens(torch.tensor([2.0]), mask)
    st = L.offpolicy_pg_loss(logp, prox, behav, adv, mask, "decoupled", cap=None, clip_eps=0.2, agg="token-mean")
    expected = -(W[0] * 1.2 * 2.0 + W[1] * 1.0 * 2.0 + W[2] * 1.0 * 2.0) / 3
    assert float(st.loss.detach()) == pytest.approx(expected, abs=1e-6)
    assert float(st.clip_frac) == pytest.approx(1 / 3, abs=1e-6)
    st.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, -W[1] * 2 / 3, -W[2] * 2 / 3], abs=1e-6)


def test_none_is_the_plain_behaviour_ratio_loss():
    logp, behav, adv, mask = _batch(adv=-1.0)
    ours = L.offpolicy_pg_loss(logp, logp.detach(), behav, adv, mask, "none", agg="seq-mean-token-mean")
    plain = L.clipped_pg_loss(logp, behav, adv, mask, agg="seq-mean-token-mean")
    assert float(ours.loss.detach()) == pytest.approx(float(plain.loss.detach())) and float(ours.weight_mean) == 1.0
    # by hand: ρ = exp(logp − behav) = [1.65, .368, 1], A = −1, ε = 0.2: −min(−ρ, −clip(ρ)) = max(ρ, clip(ρ))
    rho = [math.exp(0.5), math.exp(-1.0), 1.0]
    per = [max(r, min(max(r, 0.8), 1.2)) for r in rho]
    assert float(plain.loss.detach()) == pytest.approx(sum(per) / 3, abs=1e-6)


def test_seq_mean_aggregation_counts_dropped_tokens():
    # two rows: row 1's only token is over the cap: weight 0, but the row keeps its place in the sequence mean
    logp = torch.tensor([[-1.0, -1.0], [-0.2, 0.0]])
    behav = torch.tensor([[-1.0, -1.0], [-2.2, 0.0]])  # row 1 token 0: w = e^2 = 7.39
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = L.broadcast_to_tokens(torch.tensor([1.0, 1.0]), mask)
    st = L.offpolicy_pg_loss(logp, logp, behav, adv, mask, "decoupled", cap=5.0, agg="seq-mean-token-mean")
    assert float(st.loss.detach()) == pytest.approx((-1.0 + 0.0) / 2, abs=1e-6)  # row 0: −1; row 1: 0
    st_tis = L.offpolicy_pg_loss(logp, logp, behav, adv, mask, "tis", cap=5.0, agg="seq-mean-token-mean")
    assert float(st_tis.loss.detach()) == pytest.approx((-1.0 + -5.0) / 2, abs=1e-6)


def test_offpolicy_apo_loss_hand_computed():
    # two prompts; sequence log-probs (sums over tokens): θ, ref, prox (= θ), behav
    seq = torch.tensor([-3.0, -2.0], requires_grad=True)
    ref = torch.tensor([-3.5, -2.0])
    behav = torch.tensor([-4.0, -1.0])  # w = e^{1} = 2.718, e^{-1} = 0.368
    r, v = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5])
    beta2 = 0.1
    sq = [(beta2 * 0.5 - 0.5) ** 2, (beta2 * 0.0 + 0.5) ** 2]  # (β2 log π/πref − (r − V*))²
    st, capped = L.offpolicy_apo_loss(seq, ref, r, v, beta2, seq.detach(), behav, "tis", cap=2.0)
    assert float(st.loss.detach()) == pytest.approx((sq[0] * 2.0 + sq[1] * math.exp(-1)) / 2, abs=1e-6)
    assert float(capped) == pytest.approx(0.5)
    st_d, _ = L.offpolicy_apo_loss(seq, ref, r, v, beta2, seq.detach(), behav, "decoupled", cap=2.0)
    assert float(st_d.loss.detach()) == pytest.approx(sq[1] * math.exp(-1) / 2, abs=1e-6)  # prompt 0: weight 0
    plain, _ = L.offpolicy_apo_loss(seq, ref, r, v, beta2, seq.detach(), behav, "none")
    assert float(plain.loss.detach()) == pytest.approx(float(L.apo_loss(seq, ref, r, v, beta2).loss.detach()))


def test_tis_needs_a_cap_and_unknown_corrections_fail():
    logp, behav, adv, mask = _batch()
    with pytest.raises(ValueError, match="cap"):
        L.offpolicy_pg_loss(logp, logp, behav, adv, mask, "tis", cap=None)
    with pytest.raises(ValueError, match="unknown"):
        L.offpolicy_pg_loss(logp, logp, behav, adv, mask, "vtrace")  # type: ignore[arg-type]
