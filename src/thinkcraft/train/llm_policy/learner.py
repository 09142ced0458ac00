"""Learner: episodes -> per-turn advantages -> token rows (`build_rows`: an episode whose turns extend each
other is one row, every turn's completion trained under its own advantage) -> micro-batched loss (GRPO / RLOO /
REINFORCE / A*-PO from rl.llm_losses) over micro-batches of a token budget, packed (train/llm_policy/packing.py),
with gradient accumulation and chunked LM-head log-probs (rl/chunked_logprobs.py); checkpoint/resume of its
state."""

from __future__ import annotations

import copy
import logging
import random
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple, Sequence

import numpy as np

from thinkcraft.utils import host_memory
from thinkcraft.utils.errors import UserError
from thinkcraft.train.llm_policy.config import LLMPolicyConfig
from thinkcraft.pools.contract import Trajectory, TurnRecord
from thinkcraft.train.llm_policy import packing

log = logging.getLogger(__name__)

class RowTurns(NamedTuple):
    """Host side: which turns each row of a `TrainRows` holds (`build_rows`)."""

    starts: np.ndarray  # (R+1,) row r holds turns starts[r]:starts[r+1] (their segment ids)
    trained: np.ndarray  # (T,) bool: the turn has a trained token (a sequence of 'seq-mean-token-mean')
    turn_tokens: int  # real tokens of the one-row-per-turn layout

    def seqs_per_row(self) -> np.ndarray:
        """(R,) trained turns in each row."""
        c = np.concatenate([[0], np.cumsum(self.trained)])
        return c[self.starts[1:]] - c[self.starts[:-1]]

    def metrics(self, tokens: float) -> dict[str, float]:
        """Rows holding several turns of an episode (`episode_rows`) or one turn (`turn_rows`), and the share
        of the one-row-per-turn layout's tokens that the `tokens` trained on saved."""
        per_row = np.diff(self.starts)
        return {"learner/episode_rows": float((per_row > 1).sum()), "learner/turn_rows": float((per_row == 1).sum()),
                "learner/tokens_saved_frac": 1.0 - tokens / self.turn_tokens if self.turn_tokens else 0.0}


@dataclass
class TrainRows:
    """The learner's batch (`build_rows`): one row per turn, or per episode whose turns extend each other; the
    per-position tensors are aligned with the predicted token."""

    input_ids: Any  # (R, L) long
    attention_mask: Any  # (R, L)
    loss_mask: Any  # (R, L-1) float, 1 on trained generated tokens (aligned with predicted positions)
    old_logp: Any  # (R, L-1) engine logprobs of the sampled tokens (0 elsewhere)
    advantages: Any  # (R, L-1) per token: its turn's advantage on trained tokens (0 elsewhere)
    rewards: Any  # (T,) per turn
    segments: Any = None  # (R, L-1) long: the turn (0..T-1, in `build_rows`' order) of each generated token, -1 elsewhere
    turns: RowTurns | None = None
    allowed: Any = None  # rl.chunked_logprobs.AllowedTokens, index (R, L-1): each predicted position's grammar-
    # allowed set (json answers; -1: every token), following each turn's completion into its row like `old_logp`

    def to(self, device) -> TrainRows:
        return TrainRows(*(x.to(device) if hasattr(x, "to") else x for x in
                           (self.input_ids, self.attention_mask, self.loss_mask, self.old_logp, self.advantages,
                            self.rewards, self.segments)), self.turns,
                         None if self.allowed is None else type(self.allowed)(*(x.to(device) for x in self.allowed)))

def row_scores_and_groups(episodes: Sequence[Trajectory], gamma: float, max_turns: int):
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

def build_rows(turns: Sequence[TurnRecord], row_adv: Sequence[float], row_rewards: Sequence[float], pad_id: int,
               device, merge_episodes: bool = True, masks: Any = None) -> TrainRows:
    """The learner's rows of `turns` (an episode's turns consecutive and in order), right-padded and laid out
    with numpy in a few vectorised writes (no per-row tensors).

    Where turn k+1's prompt starts with turn k's prompt + completion, token for token (the append-only
    history of `history_turns=-1`), the two are one row: turn k+1's tokens, with every turn's completion
    trained under its own advantage, behaviour log-probs and train mask, tagged with its turn (`segments`).
    This is exact, not an approximation: causal attention shows turn k's completion the same tokens at the
    same positions in either row. With the full history an episode then costs its last turn's tokens instead
    of the sum over its turns. Turns that break the chain (a rewriting chat template, a history window) start
    a new row; `merge_episodes=False`: one row per turn.

    `masks` (`Learner.allowed_tokens`: per turn, each completion token's allowed set) makes `allowed`: each
    set lands where its token is predicted, in the turn's own row or in the episode row that extends it."""
    import torch

    T = len(turns)
    plen = np.fromiter((len(t.prompt_ids) for t in turns), np.int64, T)
    clen = np.fromiter((len(t.completion_ids) for t in turns), np.int64, T)
    tlen = plen + clen
    off = np.cumsum(tlen) - tlen
    flat = np.fromiter(chain.from_iterable(t.prompt_ids + t.completion_ids for t in turns), np.int64, int(tlen.sum()))
    joins = _continues(flat, off, plen, tlen) if merge_episodes else np.zeros(max(T - 1, 0), bool)
    starts = np.flatnonzero(np.concatenate([[True], ~joins, [True]]))  # (R+1,) each row's first turn, then T
    last = starts[1:] - 1
    lens = tlen[last]
    B, L = len(lens), int(lens.max())
    valid = np.arange(L)[None] < lens[:, None]
    ids = np.full((B, L), pad_id, dtype=np.int64)
    ids[valid] = flat[np.repeat(off[last], lens) + packing.ragged_arange(lens)]
    # predicted position q predicts token q+1: a turn's completion tokens p..p+c-1 are predicted at p-1..p+c-2,
    # in its own row and in the row of a later turn that extends it alike
    r = np.repeat(np.repeat(np.arange(B), np.diff(starts)), clen)
    q = np.repeat(plen - 1, clen) + packing.ragged_arange(clen)
    seg = np.repeat(np.arange(T), clen)
    train = np.fromiter(chain.from_iterable(t.train_mask or [1] * len(t.completion_ids) for t in turns),
                        np.float32, len(seg))
    mask, old, adv = (np.zeros((B, L - 1), dtype=np.float32) for _ in range(3))
    segments = np.full((B, L - 1), -1, dtype=np.int64)
    mask[r, q] = train
    old[r, q] = np.fromiter(chain.from_iterable(t.logprobs or [0.0] * len(t.completion_ids) for t in turns),
                            np.float32, len(seg))
    adv[r, q] = np.asarray(row_adv, dtype=np.float32)[seg] * train
    segments[r, q] = seg
    trained = np.bincount(seg, weights=train > 0, minlength=T) > 0

    def dev(a: np.ndarray) -> Any:
        return torch.from_numpy(a).to(device)

    return TrainRows(dev(ids), dev(valid.astype(np.int64)), dev(mask), dev(old), dev(adv),
                     torch.tensor(list(row_rewards), dtype=torch.float32, device=device), dev(segments),
                     RowTurns(starts, trained, int(tlen.sum())), _allowed(masks, r, q, (B, L - 1), device))


def _allowed(masks: Any, r: np.ndarray, q: np.ndarray, shape: tuple[int, int], device) -> Any:
    """`AllowedTokens` of `masks` (per turn, each completion token's entry in `masks.bitmask`) scattered to the
    (row, predicted position) of every completion token (`r`, `q` of `build_rows`), -1 elsewhere; None
    without masks."""
    if masks is None:
        return None
    import torch

    from thinkcraft.rl.chunked_logprobs import AllowedTokens

    at = np.full(shape, -1, dtype=np.int64)
    at[r, q] = np.concatenate(list(masks.index) + [np.zeros(0, np.int64)])
    return AllowedTokens(masks.bitmask.to(device), torch.from_numpy(at).to(device))


def _continues(flat: np.ndarray, off: np.ndarray, plen: np.ndarray, tlen: np.ndarray) -> np.ndarray:
    """(T-1,) bool: turn k+1's prompt starts with turn k's prompt + completion, compared token for token in one
    vectorised pass (the turns' tokens back to back in `flat`, turn k at off[k]:off[k]+tlen[k])."""
    out = np.zeros(max(len(tlen) - 1, 0), dtype=bool)
    cand = np.flatnonzero(plen[1:] >= tlen[:-1])
    n = tlen[cand]
    within = packing.ragged_arange(n)
    differ = flat[np.repeat(off[cand], n) + within] != flat[np.repeat(off[cand + 1], n) + within]
    bad = np.bincount(np.repeat(np.arange(len(cand)), n), weights=differ, minlength=len(cand))
    out[cand[bad == 0]] = True
    return out


# =========================================================================================== learner

AUTO_FIRST_TOKENS = 8192
"""`micro_batch_tokens` 0 on CUDA: the first update's budget (its first micro-batch measured)."""
AUTO_FIRST_TOKENS_HOST = 2048
"""`micro_batch_tokens` 0 off CUDA: the first update's budget, measured the same way on the host's resident set.
Not CUDA's 8,192: on the CPU a budget too large is no exception to catch and halve but the kernel's OOM killer -
the Craftax run with the bundled model (rows of ~1,700 tokens, padded attention) was killed at 24.4 GB in its first
update on a 24 GiB machine with 8,192, and peaked at 13.9 GB with 2,048 (2026-12-02)."""
HOST_HEADROOM = 0.5
"""Share of the host's available memory the measured budget may fill: the rest of the process (engine KV, the
env, Python) grows beside the learner, and a miss is fatal."""


def auto_micro_batch_tokens(bytes_per_token: float, spare_bytes: float, headroom: float = 0.85,
                            cap: int = 65536, multiple: int = 1024, floor: int = AUTO_FIRST_TOKENS) -> int:
    """The token budget that fills `headroom` of `spare_bytes` at `bytes_per_token` (a micro-batch's peak over
    what was allocated before it), rounded down to `multiple`, within [floor, cap]: never below the size just
    measured to fit, `floor` (a smaller one would only add micro-batches; running out of memory later halves it,
    `Learner.update`)."""
    fit = int(headroom * spare_bytes / max(bytes_per_token, 1.0)) // multiple * multiple
    return max(floor, min(cap, fit))


class Learner:
    """Owns the policy model and the optimizer; one `update` per step with gradient accumulation.

    Each micro-batch (a token budget, `packing.plan`) runs the decoder once - packed (varlen attention) or as
    padded rows - and only its trained positions go through the LM head, in chunks (`rl.chunked_logprobs`):
    the (tokens x vocabulary) logits never exist at once (`logit_chunk_mib=0` keeps the old full logits)."""

    def _check_devices(self) -> None:
        """Every parameter on the learner's device, or a clear error naming the ones that are not. Seen once on
        two H100s with the async pools (an engine copy on cuda:1): the first update failed inside the embedding
        with tensors on cuda:0 and cuda:1, cause not yet found (2026-11-27); this says which tensors moved."""
        want = self.device
        away = [(n, str(p.device)) for n, p in self.model.named_parameters()
                if p.device.type != want.type or (want.index is not None and p.device.index != want.index)]
        if away:
            raise RuntimeError(f"the learner's parameters must be on {want}, and {len(away)} are not (first: "
                               f"{away[:4]}): something moved the learner's model (an engine copy? a device "
                               "named without an index?)")

    def __init__(self, cfg: LLMPolicyConfig, model, tokenizer, device, autocast_dtype) -> None:
        import torch

        from thinkcraft.llm import compat
        from thinkcraft.rl.chunked_logprobs import chunk_rows

        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        compat.fx_patches_per_thread()  # the learner's thread runs forwards while engines compile, and compiles
        self.autocast_dtype = autocast_dtype
        self.params = [p for p in model.parameters() if p.requires_grad]
        # on CUDA the fused AdamW: one kernel per step for every parameter instead of a few per tensor group
        # (the async loop's learner competes with the engines' decode loops for the interpreter lock at
        # every launch: 0.97 s per update there against 0.59 s in the sync loop, 4 x H200, 2026-11-27)
        fused = bool(self.params) and all(p.is_cuda and p.is_floating_point() for p in self.params)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           **({"fused": True} if fused else {}))
        self.is_lora = cfg.finetune == "lora"
        from thinkcraft.llm.hf import fused_norm, lora_fast

        # RMSNorm as one fused kernel; on a bf16 LoRA base the adapters' forward and backward without PEFT's
        # activation casts (each module says what it saves; an engine sharing the model samples through both)
        fused_norm.install(model)
        if self.is_lora:
            lora_fast.install_for_learner(model)
        self.ref_model = None
        needs_ref = cfg.kl_coef > 0 or cfg.algo == "apo"
        if needs_ref and not self.is_lora:
            # full fine-tuning: the reference must be a frozen copy (LoRA gets it free: adapter off)
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.packed = cfg.pack and packing.packed_kernel(device) is not None
        if cfg.pack and not self.packed:
            log.warning("no varlen attention kernel with a backward runs on %s: the learner pads rows instead", device)
        packing.register_packed_attention()
        vocab = compat.plain_lm_head(model)[0].shape[0]
        self.vocab_size = vocab
        self.rows_per_chunk = chunk_rows(vocab, cfg.logit_chunk_mib) if cfg.logit_chunk_mib > 0 else 0
        self.compute_dtype = autocast_dtype if (autocast_dtype is not None and device.type == "cuda") else None
        self._parts: dict[int, Any] = {}
        self._packed_forward: dict[int, Any] = {}
        self._compiled: list[Any] = []  # the OrEager wrappers of the compiled forwards (`learner/compiled`)
        on_cuda = device.type == "cuda"
        self.micro_batch_tokens = cfg.micro_batch_tokens or (AUTO_FIRST_TOKENS if on_cuda else AUTO_FIRST_TOKENS_HOST)
        """The token budget in use: `micro_batch_tokens` (or, at 0, the first update's 8,192 - 2,048 off CUDA - and
        then the measured size: `_size_to_device`), halved after a micro-batch ran out of device memory."""
        self._memory = "device" if on_cuda else "host"
        """What `_size_to_device` measures: CUDA's allocator counters, or the host's resident set."""
        self._auto_pending = cfg.micro_batch_tokens == 0 and (on_cuda or host_memory.reset_peak())
        """Sizing still to do: the next update's first micro-batch measures its memory per token (off CUDA: the
        resident set's peak, where Linux lets it be reset; elsewhere the first budget stays)."""
        self.oom_retries = 0

    def autocast(self):
        """bf16 autocast on GPU (also around generation: full fine-tuning keeps fp32 master weights)."""
        import contextlib

        from thinkcraft.llm import compat

        if self.autocast_dtype is None or self.device.type != "cuda":
            return contextlib.nullcontext()
        return compat.autocast(self.autocast_dtype)  # no cast cache: it deadlocks threads that compile

    def _model_parts(self, model):
        """(decoder, its attention configs, head weight, head bias) of `model`, looked up once."""
        from thinkcraft.llm import compat

        if id(model) not in self._parts:
            dec = compat.decoder_of(model)
            self._parts[id(model)] = (dec, compat.attention_configs(dec), *compat.plain_lm_head(model))
        return self._parts[id(model)]

    def _packed(self, dec):
        """dec's forward over one packed (1, T) row -> its last hidden states: eager, or through torch.compile
        (`learner_compile`; dynamic shapes, one graph for every micro-batch length, eager for good after a
        failure). A plain decoder (`compat.plain_decoder`: Llama, Qwen2/3, Mistral) is compiled a layer at a
        time - one graph that every layer runs, its weights graph inputs - the rest of its forward eager: the
        whole Qwen2.5-0.5B forward and backward took 282 s to compile in the first update (H200, 2026-11-29,
        bench/results/logs/s46_h200x4_async_dedicated16_mb0_compiled.log) for 24 identical layers. Other
        decoders compile their whole forward."""
        from thinkcraft.llm import compat

        def forward(ids, positions, varlen):  # noqa: ANN001, ANN202
            return dec(input_ids=ids, position_ids=positions, use_cache=False, **varlen).last_hidden_state

        if not self.compiles(dec):
            return forward
        if id(dec) not in self._packed_forward:
            from thinkcraft.utils.fallback import compiled_or_eager

            from thinkcraft.utils.progress import console

            # said where the run's progress is (the logger's INFO is not shown): the first update is ~1-2 min longer
            console.print("learner: the packed forward goes through torch.compile (--learner-compile; the first "
                          "update compiles it, ~1-2 min for a plain decoder's layer on an H200, less with inductor's "
                          "cache warm; --learner-compile False keeps it eager)", soft_wrap=True)
            if not compat.plain_decoder(dec):
                self._packed_forward[id(dec)] = compiled_or_eager(forward, "learner forward", log, dynamic=True)
                self._compiled.append(self._packed_forward[id(dec)])
                return self._packed_forward[id(dec)]
            layer_fn = compiled_or_eager(compat.call_decoder_layer, "learner layer", log, dynamic=True)
            self._compiled.append(layer_fn)
            layers = dec.layers[: dec.config.num_hidden_layers]

            def by_layer(ids, positions, varlen):  # noqa: ANN001, ANN202
                h = dec.embed_tokens(ids)
                pe = compat.rotary(dec, h, positions)
                for layer in layers:
                    h = layer_fn(layer, h, positions, pe, varlen)
                return dec.norm(h)

            self._packed_forward[id(dec)] = by_layer
        return self._packed_forward[id(dec)]

    def compiles(self, dec) -> bool:
        """Does dec's packed forward go through torch.compile (`learner_compile`; None = auto: a CUDA learner
        packing its micro-batches, with a plain decoder)?"""
        from thinkcraft.llm import compat

        want = self.cfg.learner_compile
        if want is None:
            return self.packed and self.device.type == "cuda" and compat.plain_decoder(dec)
        return bool(want)

    def plan(self, rows: TrainRows, all_positions: bool = False) -> list:
        """The micro-batches of `rows` (`packing.plan`); `all_positions`: every position with a next token is
        read (not only the trained ones), in one padded micro-batch."""
        share = (self.packed and self.cfg.learner_share_prefix and not all_positions
                 and packing.shares_prefix(self.device))
        lengths, mask, common = packing.host_rows(rows.attention_mask, rows.loss_mask,
                                                  rows.input_ids if share else None)
        if all_positions:
            mask = (np.arange(mask.shape[1])[None] < (lengths[:, None] - 1)).astype(np.float32)
            return packing.plan(lengths, mask, 1 << 62, 0, False, self.device)
        # the tokens every row starts with (the system prompt), computed once per micro-batch; every row keeps
        # at least one token of its own
        prefix = min(common, int(lengths.min()) - 1) if len(lengths) else 0
        return packing.plan(lengths, mask, self.micro_batch_tokens, self.cfg.micro_batch_size, self.packed,
                            self.device, rows.turns.seqs_per_row() if rows.turns is not None else None,
                            prefix=prefix if prefix >= packing.MIN_SHARED_PREFIX else 0)

    def allowed_tokens(self, turns: Sequence[TurnRecord]):
        """For turns decoded under a grammar with "constrained" log-probs (json answers): each token's allowed
        set, recomputed on the CPU by replaying the completions through the grammar from where the engine
        started it (`llm.constrained.answer_start`: after the thought), forced tokens unmasked
        (`llm.constrained.ReplayMasks`, one table for all turns; for `build_rows`). None when no turn was."""
        import torch

        from thinkcraft.llm.constrained import ReplayMasks, answer_start, compile_guide, replay_masks
        from thinkcraft.llm.hf.decode import eos_ids_of

        specs = list(dict.fromkeys(t.structured for t in turns
                                   if t.structured is not None and t.structured.logprobs == "constrained"))
        if not specs:
            return None
        vocab = self.tokenizer.get_vocab()
        think = (vocab.get("<think>"), vocab.get("</think>"))
        stops = eos_ids_of(self.model, self.tokenizer)
        index = [np.full(len(t.completion_ids), -1, dtype=np.int64) for t in turns]
        tables, offset = [], 0
        for spec in specs:
            sel = [k for k, t in enumerate(turns) if t.structured == spec]
            forced = [[m == 0 for m in (turns[k].train_mask or [1] * len(turns[k].completion_ids))] for k in sel]
            starts = [answer_start(turns[k].prompt_ids, turns[k].completion_ids, f, *think) for k, f in zip(sel, forced)]
            rep = replay_masks(compile_guide(self.tokenizer, self.vocab_size, stops, spec),
                               [turns[k].completion_ids for k in sel], starts, forced)
            for k, x in zip(sel, rep.index):
                index[k] = np.where(x >= 0, x + offset, -1)
            tables.append(rep.bitmask)
            offset += len(rep.bitmask)
        return ReplayMasks(torch.cat(tables), index)

    def logprobs(self, rows: TrainRows, mb, model=None):
        """(rows, width - 1) log π of each trained position's next token in micro-batch `mb` (0 elsewhere).

        Temperature 1: engines report log π at temperature 1 (protocol), so ratios compare like with like."""
        from thinkcraft.llm import compat
        from thinkcraft.rl.chunked_logprobs import full_linear_token_logprobs, linear_token_logprobs

        dec, attn, weight, bias = self._model_parts(model or self.model)
        s, e, w = mb.start, mb.end, mb.width
        with self.autocast():
            if mb.packed:
                ids = rows.input_ids.reshape(-1)[mb.gather][None]
                with compat.attention_implementation(attn, packing.PACKED_ATTN):
                    h = self._packed(dec)(ids, mb.positions, mb.varlen())
            else:
                ids = rows.input_ids[s:e, :w]
                h = dec(input_ids=ids, attention_mask=rows.attention_mask[s:e, :w], use_cache=False).last_hidden_state
        h, ids = h.reshape(-1, h.shape[-1]), ids.reshape(-1)
        allowed = None
        if rows.allowed is not None:  # json answers: a softmax over the grammar's allowed tokens (constrained.py)
            allowed = rows.allowed._replace(index=rows.allowed.index[s:e, : w - 1].reshape(-1)[mb.scatter])
        # each trained position's next token: packed, from the batch's own rows (after a shared prefix the next
        # token in the layout is another row's)
        nxt = rows.input_ids.reshape(-1)[mb.target] if mb.packed else ids[mb.pred + 1]
        if self.rows_per_chunk:
            lp = linear_token_logprobs(h[mb.pred], weight, nxt, bias, 1.0, self.rows_per_chunk,
                                       self.compute_dtype, allowed)
        elif mb.kv_index is not None:  # full logits, of the trained positions (the layout's next tokens are not theirs)
            lp = full_linear_token_logprobs(h[mb.pred], weight, nxt, bias, 1.0, self.compute_dtype, allowed)
        else:  # the full (tokens x vocabulary) logits of every position, as the causal LM's forward builds them
            if allowed is not None:
                allowed = allowed._replace(index=allowed.index.new_full((h.shape[0],), -1).index_copy_(
                    0, mb.pred, allowed.index))
            lp = full_linear_token_logprobs(h, weight, ids.roll(-1), bias, 1.0, self.compute_dtype, allowed)[mb.pred]
        return lp.new_zeros((e - s) * (w - 1)).scatter(0, mb.scatter, lp).view(e - s, w - 1)

    def ref_logprobs(self, rows: TrainRows, mb):
        import torch

        with torch.no_grad():
            if self.ref_model is not None:
                return self.logprobs(rows, mb, model=self.ref_model)
            with self.model.disable_adapter():
                return self.logprobs(rows, mb)

    def token_logprobs(self, input_ids, attention_mask, model=None):
        """(B, L-1) log π of every next token of right-padded rows (0 after each row's end)."""
        import torch

        rows = TrainRows(input_ids, attention_mask, torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1,
                                                                device=input_ids.device), None, None, None)
        (mb,) = self.plan(rows, all_positions=True)
        return self.logprobs(rows, mb, model=model)

    def update(self, rows: TrainRows, v_star=None) -> dict[str, float]:
        """One optimizer step over all rows, micro-batched by tokens (`packing.plan`). Each micro-batch's loss
        is weighted by its share of the batch (tokens or sequences, as the aggregation counts them), so
        accumulation equals the full-batch loss. The loop reads nothing back from the device: the
        statistics are summed there and read once at the end. `rows` come from `build_rows`; `v_star` (A*-PO)
        is per turn, as `rows.rewards`.

        A micro-batch that runs out of device memory: the gradients so far are dropped, the token budget halved
        (for the rest of the run, with a warning; `learner/oom_retries` counts) and the update done again -
        nothing stepped twice, nothing lost. Once a micro-batch of one row does not fit: a clear error."""
        import torch

        if rows.segments is None or rows.turns is None:
            raise ValueError("Learner.update takes the rows of build_rows (per-token segments and their turns)")
        cfg = self.cfg
        self._check_devices()
        self.model.train()
        mbs, stats = self._accumulate_fitting(rows, v_star)
        if cfg.max_grad_norm > 0:
            stats["losses/grad_norm"] = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
        self.optimizer.step()
        self.model.eval()
        names = list(stats)
        values = torch.stack([torch.as_tensor(stats[k], dtype=torch.float32, device=self.device).reshape(())
                              for k in names]).tolist()
        layout = packing.layout_summary(mbs)
        return {**dict(zip(names, values)), **layout, **rows.turns.metrics(layout["learner/tokens"]),
                "learner/oom_retries": float(self.oom_retries),
                "learner/micro_batch_tokens": float(self.micro_batch_tokens),
                # 1 while the packed forward runs compiled (`learner_compile`), 0 when eager or after a failure
                "learner/compiled": float(bool(self._compiled)
                                          and not any(getattr(f, "failed", False) for f in self._compiled))}

    def _accumulate_fitting(self, rows: TrainRows, v_star) -> tuple[list, dict[str, Any]]:
        """(micro-batches, statistics) of the batch's gradients, accumulated from zero; on running out of device
        memory, again from zero with half the token budget (see `update`)."""
        import torch

        while True:
            self.optimizer.zero_grad(set_to_none=True)
            mbs = self.plan(rows)
            try:
                return mbs, self._accumulate(rows, mbs, v_star)
            except torch.OutOfMemoryError as e:
                if all(m.end - m.start == 1 for m in mbs):  # halving cannot split a row
                    self.optimizer.zero_grad(set_to_none=True)
                    raise UserError(
                        f"the learner ran out of device memory with micro-batches of one row (the longest "
                        f"{max(m.tokens for m in mbs)} tokens; budget {self.micro_batch_tokens}): shorten episodes "
                        "(--max-turns, --max-new-tokens), train LoRA instead of every weight, or leave the learner "
                        "more device memory (--kv-cache-gb)") from e
            except torch._dynamo.exc.TorchDynamoException as e:
                if not self._compiled_backward_failed(e):
                    raise
                continue  # the update again from zero, eager
            # out of the except block: the failed micro-batch's tensors (held by the traceback) are gone
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._auto_pending = False  # a measured size that did not fit is never grown again
            self.micro_batch_tokens = max(self.micro_batch_tokens // 2, 1)
            self.oom_retries += 1
            log.warning("learner: out of device memory; micro-batch budget halved to %d tokens for the rest of the "
                        "run (--micro-batch-tokens), the update's gradients computed again", self.micro_batch_tokens)

    def _compiled_backward_failed(self, e: Exception) -> bool:
        """A compiler failure out of `backward()` - inductor compiles the backward graph at the first backward, past
        `OrEager`'s reach in the forward (seen: a `.so` left empty in inductor's cache by a process killed while it
        compiled, "file too short") - sends every compiled learner function to its eager twin for good, with one
        warning, and the update is computed again (True); False where nothing compiled was running (re-raised)."""
        live = [f for f in self._compiled if not getattr(f, "failed", True)]
        if not live:
            return False
        for f in live:
            f.failed = True
        self.optimizer.zero_grad(set_to_none=True)
        log.warning("compiled learner backward unavailable (%s: %s); running eager (the update's gradients computed "
                    "again)", type(e).__name__, e)
        return True

    def _accumulate(self, rows: TrainRows, mbs: list, v_star) -> dict[str, Any]:
        """Forward and backward of every micro-batch, each loss weighted by its share of the batch; returns the
        weighted statistics as device tensors (nothing read back here)."""
        cfg = self.cfg
        total_tokens = max(sum(m.trained_tokens for m in mbs), 1)
        total_seqs = max(sum(m.trained_seqs for m in mbs), 1)
        by_tokens = cfg.algo != "apo" and cfg.loss_agg == "token-mean"
        stats: dict[str, Any] = dict.fromkeys(("losses/loss", "losses/pg", "losses/kl", "losses/clip_frac",
                                               "losses/ratio"), 0.0)
        for mb in mbs:
            if mb.trained_tokens == 0:
                continue
            weight = mb.trained_tokens / total_tokens if by_tokens else mb.trained_seqs / total_seqs
            probe = self._memory_probe_start() if self._auto_pending else None
            loss, parts = self._micro_loss(rows, mb, v_star)
            (loss * weight).backward()
            if probe is not None:
                self._size_to_device(probe, mb.tokens)
            for k, v in parts.items():
                stats[k] = stats.get(k, 0.0) + v.detach() * weight
        return stats

    def _memory_probe_start(self) -> int:
        """Device memory allocated before a micro-batch, its peak counter reset (`_size_to_device` reads it); off
        CUDA the host's resident set and its peak."""
        import torch

        if self._memory == "host":
            host_memory.reset_peak()
            return host_memory.rss_bytes() or 0
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def _size_to_device(self, base_bytes: int, tokens: int) -> None:
        """`micro_batch_tokens` 0: the budget of the updates to come, from this micro-batch's peak memory over
        `base_bytes` per token and the memory the device has left (free, plus what torch's allocator holds
        unused). This update keeps the plan it started with."""
        import torch

        self._auto_pending = False
        if self._memory == "host":
            # the host: the resident set's peak over the micro-batch, and what the machine has left plus what the
            # process took since (freed tensors the allocator keeps are reused, not asked for again)
            peak, now, avail = host_memory.peak_rss_bytes(), host_memory.rss_bytes(), host_memory.available_bytes()
            if peak is None or now is None or avail is None:
                return
            spare, headroom = avail + max(now - base_bytes, 0), HOST_HEADROOM
        else:
            peak = torch.cuda.max_memory_allocated(self.device)
            free, _ = torch.cuda.mem_get_info(self.device)
            spare = free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            headroom = 0.85
        per_token = max(peak - base_bytes, 1) / max(tokens, 1)
        self.micro_batch_tokens = auto_micro_batch_tokens(per_token, spare, headroom=headroom,
                                                          floor=self.micro_batch_tokens)
        log.info("learner: micro-batches of %d tokens from now on (%.2f MiB of %s memory per token measured on %d "
                 "tokens, %.1f GiB left)", self.micro_batch_tokens, per_token / 2**20, self._memory, tokens, spare / 2**30)

    def _micro_loss(self, rows: TrainRows, mb, v_star):
        """(loss, {metric: value}) of one micro-batch, on the (rows, width - 1) layout of `build_rows`. Its
        sequences are its turns (`segments`, renumbered from 0 here), whether a row holds one or several."""
        from thinkcraft.rl import llm_losses as L

        cfg = self.cfg
        sl, w = slice(mb.start, mb.end), mb.width
        mask = rows.loss_mask[sl, : w - 1]
        first, end = int(rows.turns.starts[mb.start]), int(rows.turns.starts[mb.end])
        seg, n_seg = (rows.segments[sl, : w - 1] - first).clamp(min=0), end - first
        logp = self.logprobs(rows, mb)
        # off-policy corrections (async rollouts, --offpolicy): one optimizer step per batch, so the proximal
        # policy is this forward's own log-probs, detached; the behaviour log-probs are the engine's
        # (rl.llm_losses, "off-policy corrections"). "none" is the plain ratio to the behaviour policy.
        behav, cap = rows.old_logp[sl, : w - 1], cfg.offpolicy_cap or None
        corrected = cfg.offpolicy != "none"
        if cfg.algo == "apo":
            ref = self.ref_logprobs(rows, mb)
            seq = L.sequence_logprob(logp, mask, seg, n_seg)
            st, capped = L.offpolicy_apo_loss(seq, L.sequence_logprob(ref, mask, seg, n_seg), rows.rewards[first:end],
                                              v_star[first:end], cfg.apo_beta2, seq.detach(),
                                              L.sequence_logprob(behav, mask, seg, n_seg), cfg.offpolicy, cap)
            parts = {"losses/loss": st.loss, "apo/log_ratio": st.log_ratio_mean}
            return st.loss, ({**parts, "offpolicy/capped_frac": capped} if corrected else parts)
        ref = self.ref_logprobs(rows, mb) if cfg.kl_coef > 0 else None
        st = L.offpolicy_pg_loss(logp, logp.detach(), behav, rows.advantages[sl, : w - 1], mask, cfg.offpolicy, cap,
                                 clip_eps=cfg.clip_eps, ref_logp=ref, kl_coef=cfg.kl_coef, agg=cfg.loss_agg,
                                 segments=seg, num_segments=n_seg)
        parts = {"losses/loss": st.loss, "losses/pg": st.pg_loss, "losses/kl": st.kl,
                 "losses/clip_frac": st.clip_frac, "losses/ratio": st.ratio_mean}
        if corrected:
            parts.update({"offpolicy/weight_mean": st.weight_mean, "offpolicy/capped_frac": st.capped_frac})
        return st.loss, parts

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
