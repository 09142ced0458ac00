"""Learner: episodes -> per-row advantages -> padded token batches -> micro-batched loss (GRPO / RLOO /
REINFORCE / A*-PO from rl.llm_losses) with gradient accumulation; checkpoint/resume of its state."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from thinkcraft.utils.errors import UserError
from thinkcraft.train.llm_policy.config import LLMPolicyConfig
from thinkcraft.train.llm_policy.rollout import Episode, TurnSample


@dataclass
class TrainRows:
    """One row per turn: right-padded [prompt | completion] token ids and what the loss needs."""

    input_ids: Any  # (B, L) long
    attention_mask: Any  # (B, L)
    loss_mask: Any  # (B, L-1) float, 1 on trained generated tokens (aligned with predicted positions)
    old_logp: Any  # (B, L-1) engine logprobs of the sampled tokens (0 elsewhere)
    advantages: Any  # (B,) per-row (turn) advantage or, for A*-PO, r - V*
    rewards: Any  # (B,)

def row_scores_and_groups(episodes: Sequence[Episode], gamma: float, max_turns: int):
    """Flatten episodes to turns: returns-to-go scores and group ids (seed group × turn index), so a turn
    is compared with the same turn of the other samples of its seed."""
    from thinkcraft.rl.llm_losses import discounted_returns

    scores, groups = [], []
    for e in episodes:
        g = discounted_returns([t.reward for t in e.turns], gamma)
        for k, _ in enumerate(e.turns):
            scores.append(g[k])
            groups.append(e.group * (max_turns + 1) + k)
    return scores, groups

def build_rows(turns: Sequence[TurnSample], row_adv: Sequence[float], row_rewards: Sequence[float], pad_id: int,
               device) -> TrainRows:
    import torch

    seqs = [t.prompt_ids + t.completion_ids for t in turns]
    L = max(len(s) for s in seqs)
    B = len(seqs)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L - 1), dtype=torch.float32)
    old = torch.zeros((B, L - 1), dtype=torch.float32)
    for i, (t, s) in enumerate(zip(turns, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        p, c = len(t.prompt_ids), len(t.completion_ids)
        if c:
            # predicted position q predicts token q+1: completion tokens p..p+c-1 are predicted at p-1..p+c-2
            mask[i, p - 1 : p - 1 + c] = torch.tensor(t.train_mask or [1] * c, dtype=torch.float32)
            if t.logprobs:
                old[i, p - 1 : p - 1 + c] = torch.tensor(t.logprobs, dtype=torch.float32)
    return TrainRows(ids.to(device), attn.to(device), mask.to(device), old.to(device),
                     torch.tensor(list(row_adv), dtype=torch.float32, device=device),
                     torch.tensor(list(row_rewards), dtype=torch.float32, device=device))


# =========================================================================================== learner

class Learner:
    """Owns the policy model and the optimizer; one `update` per step with gradient accumulation."""

    def __init__(self, cfg: LLMPolicyConfig, model, tokenizer, device, autocast_dtype) -> None:
        import torch

        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.is_lora = cfg.finetune == "lora"
        self.ref_model = None
        needs_ref = cfg.kl_coef > 0 or cfg.algo == "apo"
        if needs_ref and not self.is_lora:
            # full fine-tuning: the reference must be a frozen copy (LoRA gets it free: adapter off)
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)

    def autocast(self):
        """bf16 autocast on GPU (also around generation: full fine-tuning keeps fp32 master weights)."""
        import contextlib

        import torch

        if self.autocast_dtype is None or self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.autocast_dtype)

    def token_logprobs(self, input_ids, attention_mask, model=None):
        from thinkcraft.rl.llm_losses import token_logprobs

        model = model or self.model
        with self.autocast():
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        # temperature 1: engines report log π at temperature 1 (protocol), so ratios compare like with like
        return token_logprobs(logits, input_ids)

    def ref_token_logprobs(self, input_ids, attention_mask):
        import torch

        with torch.no_grad():
            if self.ref_model is not None:
                return self.token_logprobs(input_ids, attention_mask, model=self.ref_model)
            with self.model.disable_adapter():
                return self.token_logprobs(input_ids, attention_mask)

    def update(self, rows: TrainRows, v_star=None) -> dict[str, float]:
        """One optimizer step over all rows, micro-batched. Each micro-batch's loss is weighted by its share
        of the batch (tokens or sequences, as the aggregation counts them), so accumulation equals the
        full-batch loss."""
        import torch

        from thinkcraft.rl import llm_losses as L

        cfg = self.cfg
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        B = rows.input_ids.shape[0]
        mb = cfg.micro_batch_size
        total_tokens = float(rows.loss_mask.sum().clamp(min=1.0))
        total_seqs = float((rows.loss_mask.sum(-1) > 0).sum().clamp(min=1))
        stats: dict[str, float] = {"losses/loss": 0.0, "losses/pg": 0.0, "losses/kl": 0.0, "losses/clip_frac": 0.0,
                                   "losses/ratio": 0.0}
        for s in range(0, B, mb):
            sl = slice(s, min(s + mb, B))
            ids, attn, mask = rows.input_ids[sl], rows.attention_mask[sl], rows.loss_mask[sl]
            # trim right padding shared by the micro-batch
            L_mb = int(attn.sum(-1).max())
            ids, attn, mask = ids[:, :L_mb], attn[:, :L_mb], mask[:, : L_mb - 1]
            n_tok = float(mask.sum())
            n_seq = float((mask.sum(-1) > 0).sum())
            if n_tok == 0:
                continue
            logp = self.token_logprobs(ids, attn)
            if cfg.algo == "apo":
                ref = self.ref_token_logprobs(ids, attn)
                st = L.apo_loss(L.sequence_logprob(logp, mask), L.sequence_logprob(ref, mask),
                                rows.rewards[sl], v_star[sl], cfg.apo_beta2)
                weight = n_seq / total_seqs
                loss = st.loss * weight
                stats["losses/loss"] += float(st.loss.detach()) * weight
                stats["apo/log_ratio"] = stats.get("apo/log_ratio", 0.0) + float(st.log_ratio_mean) * weight
            else:
                ref = self.ref_token_logprobs(ids, attn) if cfg.kl_coef > 0 else None
                adv = L.broadcast_to_tokens(rows.advantages[sl], mask)
                st = L.clipped_pg_loss(logp, rows.old_logp[sl, : L_mb - 1], adv, mask, clip_eps=cfg.clip_eps,
                                       ref_logp=ref, kl_coef=cfg.kl_coef, agg=cfg.loss_agg)
                weight = (n_tok / total_tokens) if cfg.loss_agg == "token-mean" else (n_seq / total_seqs)
                loss = st.loss * weight
                stats["losses/loss"] += float(st.loss.detach()) * weight
                stats["losses/pg"] += float(st.pg_loss) * weight
                stats["losses/kl"] += float(st.kl) * weight
                stats["losses/clip_frac"] += float(st.clip_frac) * weight
                stats["losses/ratio"] += float(st.ratio_mean) * weight
            loss.backward()
        if cfg.max_grad_norm > 0:
            gn = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
            stats["losses/grad_norm"] = float(gn)
        self.optimizer.step()
        self.model.eval()
        return stats

    # ---------------------------------------------------------------- checkpoints

    def trainable_state(self) -> dict[str, Any]:
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def load_trainable_state(self, state: dict[str, Any]) -> None:
        import torch

        named = dict(self.model.named_parameters())
        missing = [n for n in state if n not in named]
        if missing:
            raise UserError(f"checkpoint does not match the model (unknown parameter {missing[0]}); "
                            "use the same --model/--finetune/--lora-rank as the run that wrote it")
        with torch.no_grad():
            for n, v in state.items():
                named[n].copy_(v.to(named[n].device, named[n].dtype))

def checkpoint_state(learner: Learner, step: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Everything a resumed run needs (encoded by train.checkpoint.TORCH_CODEC): trainable weights,
    optimizer, step, every RNG state, and the loop's carry (`extra`: baseline, V* table)."""
    import torch

    return {
        "step": step,
        "trainable": learner.trainable_state(),
        "optimizer": learner.optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        "extra": extra,
    }


def restore_state(learner: Learner, state: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Load a `checkpoint_state` into the learner and the RNGs; returns (step, extra)."""
    import torch

    learner.load_trainable_state(state["trainable"])
    learner.optimizer.load_state_dict(state["optimizer"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return int(state["step"]), state["extra"]
