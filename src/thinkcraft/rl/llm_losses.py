"""LLM-policy losses and advantage estimators (torch, pure functions).

Shapes: a batch row is one generated turn (prompt + completion, right-padded to L tokens). Token tensors
are (B, L) and aligned with the *predicted* token (logprob of token t given tokens < t); `mask` is 1 on
generated tokens only, so prompt and padding tokens are never trained.

Estimators take a flat vector of scores with integer `group_ids`: rows sharing an id are rollouts of the
same prompt/seed (GRPO/RLOO groups). Multi-turn episodes feed per-turn returns-to-go with a group id per
(seed, turn index), so a turn is compared with the same turn of its siblings.

References: GRPO (Shao et al. 2024, DeepSeekMath), RLOO (Ahmadian et al. 2024, "Back to Basics"),
k3 KL estimator (Schulman, "Approximating KL divergence", 2020), A*-PO (Brantley et al. 2025,
"Accelerating RL for LLM Reasoning with Optimal Advantage Regression").
"""

from __future__ import annotations

from typing import Callable, Literal, NamedTuple, Sequence

import torch

LossAgg = Literal["token-mean", "seq-mean-token-mean"]


# ------------------------------------------------------------------------------------------ helpers


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` where `mask` is 1 (0 where the mask is empty, never NaN)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def segment_sum(x: torch.Tensor, segments: torch.Tensor, num_segments: int) -> torch.Tensor:
    """(num_segments,) sums of `x` over the positions of each segment id (`segments`: x's shape, ids in
    [0, num_segments))."""
    return x.new_zeros(num_segments).index_add(0, segments.reshape(-1), x.reshape(-1))


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: LossAgg, segments: torch.Tensor | None = None,
              num_segments: int = 0) -> torch.Tensor:
    """'token-mean': every generated token weighs the same (DAPO, Dr. GRPO); 'seq-mean-token-mean':
    mean over each sequence's tokens, then over sequences (the original GRPO objective).

    The sequences are the rows, or with `segments` (per-token ids in [0, num_segments) where the mask is set)
    the segments: the turns of an episode trained as one row (`learner.build_rows`) each stay a sequence of
    their own. 'token-mean' ignores them."""
    if how == "token-mean":
        return masked_mean(per_token, mask)
    if how == "seq-mean-token-mean" and segments is not None:
        m = mask.to(per_token.dtype)
        tokens = segment_sum(m, segments, num_segments)
        has_tokens = (tokens > 0).to(per_token.dtype)
        per_seq = segment_sum(per_token * m, segments, num_segments) / tokens.clamp(min=1.0)
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    if how == "seq-mean-token-mean":
        has_tokens = (mask.sum(-1) > 0).to(per_token.dtype)
        per_seq = masked_mean(per_token, mask, dim=-1)
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    raise ValueError(f"unknown loss aggregation {how!r}")


def completion_mask(prompt_lens: torch.Tensor, total_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(B, L-1) mask over *predicted* positions: position t predicts token t+1, which is generated iff
    prompt_len <= t+1 < total_len. Use with `token_logprobs` outputs."""
    pos = torch.arange(1, seq_len, device=prompt_lens.device)[None, :]
    return ((pos >= prompt_lens[:, None]) & (pos < total_lens[:, None])).to(torch.float32)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, L-1) log π(input_ids[:, t+1] | input_ids[:, :t+1]) from (B, L, V) logits.

    Uses logsumexp row by row (not a full (B, L, V) log_softmax copy) to keep peak memory near the logits'.
    """
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:]
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


# ------------------------------------------------------------------------------- advantage estimators


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group count, group sum and group sum of squares (via index_add over dense ids)."""
    _, dense = torch.unique(group_ids, return_inverse=True)
    n_groups = int(dense.max().item()) + 1 if dense.numel() else 0
    s = scores.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64, device=scores.device).index_add_(0, dense, torch.ones_like(s))
    total = torch.zeros_like(count).index_add_(0, dense, s)
    sq = torch.zeros_like(count).index_add_(0, dense, s * s)
    return count[dense], total[dense], sq[dense]


def grpo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO: (r - mean_group) / (std_group + eps), with the population std of the group (TRL divides by
    the unbiased std; the two differ by sqrt(G/(G-1))). A group of equal rewards gets 0 advantage.
    `scale_by_std=False` is Dr. GRPO's unscaled variant."""
    count, total, sq = _group_stats(scores, group_ids)
    mean = total / count
    adv = scores.to(torch.float64) - mean
    if scale_by_std:
        var = (sq / count - mean * mean).clamp(min=0.0)
        adv = adv / (var.sqrt() + eps)
    return adv.to(scores.dtype)


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i - mean of the *other* rollouts of its group. A group of one has no baseline: 0."""
    count, total, _ = _group_stats(scores, group_ids)
    s = scores.to(torch.float64)
    others = (total - s) / (count - 1).clamp(min=1.0)
    adv = torch.where(count > 1, s - others, torch.zeros_like(s))
    return adv.to(scores.dtype)


def reinforce_advantages(scores: torch.Tensor, baseline: float | torch.Tensor) -> torch.Tensor:
    """REINFORCE with a baseline (a running mean of past rewards, kept by the caller)."""
    return scores - baseline


def update_running_baseline(baseline: float | None, scores: torch.Tensor, momentum: float) -> float:
    """Exponential moving average of the batch mean; the first batch initialises it."""
    m = float(scores.float().mean())
    return m if baseline is None else momentum * baseline + (1.0 - momentum) * m


class AdvantageInputs(NamedTuple):
    """What an advantage estimator sees: one row per generated turn."""

    scores: torch.Tensor  # (B,) returns-to-go
    group_ids: torch.Tensor  # (B,) rows sharing an id are samples of the same prompt (and turn)
    v_star: torch.Tensor | None = None  # (B,) A*-PO: V*(x) of each row's prompt
    baseline: float | None = None  # REINFORCE: the running reward baseline (None before the first batch)


class AdvantageOptions(NamedTuple):
    scale_by_std: bool = True  # GRPO: divide by the group std (False = Dr. GRPO)
    baseline_momentum: float = 0.9  # REINFORCE: EMA momentum of the baseline


class Advantages(NamedTuple):
    values: torch.Tensor  # (B,) per-row advantages (A*-PO: r - V*, its regression target)
    baseline: float | None  # the baseline to carry to the next batch


def _grpo(x: AdvantageInputs, o: AdvantageOptions) -> Advantages:
    return Advantages(grpo_advantages(x.scores, x.group_ids, scale_by_std=o.scale_by_std), x.baseline)


def _rloo(x: AdvantageInputs, o: AdvantageOptions) -> Advantages:
    return Advantages(rloo_advantages(x.scores, x.group_ids), x.baseline)


def _reinforce(x: AdvantageInputs, o: AdvantageOptions) -> Advantages:
    # the first batch is its own baseline (advantages centred), later batches use the running mean
    b = float(x.scores.float().mean()) if x.baseline is None else x.baseline
    return Advantages(reinforce_advantages(x.scores, b),
                      update_running_baseline(x.baseline, x.scores, o.baseline_momentum))


def _apo(x: AdvantageInputs, o: AdvantageOptions) -> Advantages:
    if x.v_star is None:
        raise ValueError("A*-PO advantages need v_star (the offline V* of each row's prompt)")
    return Advantages(x.scores - x.v_star.to(x.scores.dtype), x.baseline)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[AdvantageInputs, AdvantageOptions], Advantages]] = {
    "grpo": _grpo,
    "rloo": _rloo,
    "reinforce": _reinforce,
    "apo": _apo,
}
"""Algorithm name (`--algo`) -> advantage estimator, all with one signature."""


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """Returns-to-go G_t = r_t + γ G_{t+1} of one episode's per-turn rewards."""
    out = [0.0] * len(rewards)
    g = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        g = float(rewards[t]) + gamma * g
        out[t] = g
    return out


def broadcast_to_tokens(row_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-turn advantage -> (B, L) token advantages, zero outside generated tokens."""
    return row_values[:, None].to(mask.dtype) * mask


# ------------------------------------------------------------------------------------------- losses


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π || π_ref): exp(ref - logp) - (ref - logp) - 1 (≥ 0, unbiased)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


class PGStats(NamedTuple):
    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl: torch.Tensor
    clip_frac: torch.Tensor
    ratio_mean: torch.Tensor


def clipped_pg_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    agg: LossAgg = "seq-mean-token-mean",
    segments: torch.Tensor | None = None,
    num_segments: int = 0,
) -> PGStats:
    """PPO/GRPO clipped surrogate over generated tokens, plus an optional k3 KL penalty to the reference.

    -min(ρ A, clip(ρ, 1-ε, 1+ε_high) A) with ρ = exp(logp - old_logp). With one update per batch and
    `old_logp` equal to the current policy's, ρ = 1 and this is the plain policy gradient (REINFORCE/RLOO).
    `advantages` are per token; `segments`: the sequences of 'seq-mean-token-mean' (`aggregate`).
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    pg = aggregate(per_token, mask, agg, segments, num_segments)
    if ref_logp is not None and kl_coef != 0.0:
        kl = aggregate(k3_kl(logp, ref_logp), mask, agg, segments, num_segments)
    else:
        kl = torch.zeros((), dtype=logp.dtype, device=logp.device)
    loss = pg + kl_coef * kl
    with torch.no_grad():
        clip_frac = masked_mean((unclipped != clipped).to(logp.dtype), mask)
        ratio_mean = masked_mean(ratio, mask)
    return PGStats(loss, pg.detach(), kl.detach(), clip_frac, ratio_mean)


def apo_value(ref_rewards: torch.Tensor, beta1: float) -> torch.Tensor:
    """A*-PO's optimal value V*(x) = β1 log E_{y~π_ref}[exp(r(x, y)/β1)] from N reference samples.

    `ref_rewards`: (P, N) rewards of N reference samples for each of P prompts -> (P,). Computed with
    logsumexp for stability; β1 → 0 tends to the max, β1 → ∞ to the mean.
    """
    n = ref_rewards.shape[-1]
    r = ref_rewards.to(torch.float64)
    v = beta1 * (torch.logsumexp(r / beta1, dim=-1) - torch.log(torch.tensor(float(n), dtype=torch.float64)))
    return v.to(ref_rewards.dtype)


class APOStats(NamedTuple):
    loss: torch.Tensor
    log_ratio_mean: torch.Tensor
    advantage_mean: torch.Tensor


def apo_loss(
    seq_logp: torch.Tensor, seq_ref_logp: torch.Tensor, rewards: torch.Tensor, v_star: torch.Tensor, beta2: float
) -> APOStats:
    """A*-PO regression: mean over prompts of (β2 · log πθ(y|x)/πref(y|x) − (r − V*(x)))².

    `seq_logp`/`seq_ref_logp`: (P,) summed token logprobs of each prompt's single online sample.
    """
    log_ratio = seq_logp - seq_ref_logp
    adv = rewards - v_star
    loss = ((beta2 * log_ratio - adv) ** 2).mean()
    return APOStats(loss, log_ratio.detach().mean(), adv.detach().mean())


def sequence_logprob(token_logp: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None = None,
                     num_segments: int = 0) -> torch.Tensor:
    """(B, L) token logprobs -> (B,) sum over generated tokens; with `segments` (per-token ids), the
    (num_segments,) sums of each segment instead."""
    if segments is not None:
        return segment_sum(token_logp * mask.to(token_logp.dtype), segments, num_segments)
    return (token_logp * mask.to(token_logp.dtype)).sum(-1)
