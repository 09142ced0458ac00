"""Per-slot decode state on the device, and the pure functions that advance it one token.

Every decode iteration runs the same fixed-shape tensor program over all S slots (inactive ones masked):
sample (`sample_rows`: per-row temperature and top-p, greedy where temperature is 0), then `advance_rows`:
the thinking budget (a row whose thought reached its budget is forced to emit `thinking_close_text`, one
token per step, in the same sequence - no second request), thinking-token counts, EOS and max-token ends.
No host logic per row and per token: the host reads one small record per iteration (`RECORD_FIELDS`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from thinkcraft.llm.hf.fused_sampler import fused_sampler_serves, sample_and_lse

NO_BUDGET = 1 << 40
"""Budget of rows without a thinking budget (their thoughts are counted, never cut)."""

RECORD_FIELDS = ("token", "done", "forced", "think_tokens", "truncated")
"""Columns of the (S, 5) int64 record an iteration hands the host (its logprobs come apart, float32)."""


class RowState(NamedTuple):
    """(S,) tensors, one entry per slot."""

    active: torch.Tensor
    """bool: the slot runs a sequence that has not ended."""
    n_gen: torch.Tensor
    """Tokens generated so far."""
    max_new: torch.Tensor
    in_think: torch.Tensor
    """bool: inside an open `<think>`."""
    think_tokens: torch.Tensor
    budget: torch.Tensor
    force_pos: torch.Tensor
    """Index into the close sequence of the next forced token; -1: not forcing."""
    truncated: torch.Tensor
    """bool: the thought was cut by the budget."""
    length: torch.Tensor
    """Columns of the slot cache holding KV (the next token's KV goes to column `length`)."""
    offset: torch.Tensor
    """Position of column 0: the shared prefix's length for rows reading it, else 0."""
    temperature: torch.Tensor
    top_p: torch.Tensor

    @classmethod
    def empty(cls, slots: int, device: torch.device) -> "RowState":
        def z(dtype: torch.dtype, fill: float = 0) -> torch.Tensor:
            return torch.full((slots,), fill, dtype=dtype, device=device)

        return cls(active=z(torch.bool), n_gen=z(torch.long), max_new=z(torch.long), in_think=z(torch.bool),
                   think_tokens=z(torch.long), budget=z(torch.long, NO_BUDGET), force_pos=z(torch.long, -1),
                   truncated=z(torch.bool), length=z(torch.long), offset=z(torch.long), temperature=z(torch.float32),
                   top_p=z(torch.float32, 1.0))


class ThinkTokens(NamedTuple):
    """Token ids the state machine needs, on the device."""

    open_id: int
    close_id: int
    close_seq: torch.Tensor
    """(C,) the forced close sequence (`thinking_close_text` tokenized)."""
    eos: torch.Tensor
    """(E,) end-of-sequence ids."""


def top_p_filter(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of tokens whose probability reaches top_p (the most
    likely token is always kept); the rest get -inf. `top_p` may be a (B, 1) tensor (one per row)."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    drop_sorted = before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, any_sampled: bool,
                any_top_p: bool, gen: torch.Generator | None) -> torch.Tensor:
    """(S,) next tokens: argmax where temperature <= 0, else a sample of softmax(logits / T) restricted to the
    row's top-p nucleus. `any_sampled` / `any_top_p` (known to the host) skip the work nobody needs."""
    greedy = logits.argmax(-1)
    if not any_sampled:
        return greedy
    z = logits / temperature.clamp(min=1e-6)[:, None]
    if any_top_p:
        # rows at top_p 1 keep everything (a threshold no cumulative mass reaches, float rounding included)
        z = top_p_filter(z, torch.where(top_p < 1.0, top_p, 2.0)[:, None])
    # a sample of softmax(z) as argmax(p / E) with E ~ Exp(1) i.i.d. (the exponential race; the Gumbel-max
    # trick in other clothes): one fill and one reduction, no cumulative sums (vLLM samples this way too)
    probs = torch.softmax(z, dim=-1)
    sampled = (probs / torch.empty_like(probs).exponential_(generator=gen)).argmax(-1)
    return torch.where(temperature > 0, sampled, greedy)


def sample_rows_lse(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, any_sampled: bool,
                    any_top_p: bool, gen: torch.Generator | None, seed: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sample_rows`, in one pass over the logits where the one-pass kernel serves (fused_sampler.py: sampled
    rows, no top-p, no per-call generator, a device `seed`), which also gives the rows' logsumexp for
    `token_logprobs`; else the torch sampler and None."""
    if any_sampled and not any_top_p and gen is None and seed is not None and fused_sampler_serves(logits):
        return sample_and_lse(logits, temperature, seed)
    return sample_rows(logits, temperature, top_p, any_sampled, any_top_p, gen), None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """(S,) log-softmax of `logits` (S, V) at each row's token: the logit less the row's logsumexp (`lse` where
    the sampler computed it). Why not `log_softmax(...).gather(...)`: that writes and reads back an (S, V) float32
    tensor every decode step - 78 MB at 128 slots of a 151,936-token vocabulary - to keep S values; a logsumexp
    reads the logits once."""
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(1, tokens[:, None]).squeeze(1) - lse


def advance_rows(
    st: RowState, tok: torch.Tensor, think: ThinkTokens
) -> tuple[RowState, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token for every active row: (new state, tokens (forced ones substituted), forced (S,) bool,
    done (S,) bool). A row whose thought reached its budget starts the close sequence this step (the
    tokens it forces are the model's input, not samples); EOS ends a row unless it is forcing."""
    a = st.active
    start = a & st.in_think & (st.force_pos < 0) & (st.think_tokens >= st.budget)
    force_pos = torch.where(start, torch.zeros_like(st.force_pos), st.force_pos)
    forced = a & (force_pos >= 0)
    n_close = think.close_seq.shape[0]
    tok = torch.where(forced, think.close_seq[force_pos.clamp(0, max(n_close - 1, 0))], tok)
    sampled = a & ~forced
    is_open, is_close = tok == think.open_id, tok == think.close_id
    think_tokens = st.think_tokens + (sampled & st.in_think & ~is_open & ~is_close).long()
    in_think = torch.where(sampled & is_open, True, st.in_think)
    in_think = torch.where((sampled & is_close) | start, False, in_think)
    force_pos = torch.where(forced, force_pos + 1, force_pos)
    force_pos = torch.where(force_pos >= n_close, -1, force_pos)
    n_gen = st.n_gen + a.long()
    eos = torch.isin(tok, think.eos) & ~forced
    done = a & (eos | (n_gen >= st.max_new))
    new = st._replace(n_gen=n_gen, in_think=in_think, think_tokens=think_tokens, force_pos=force_pos,
                      truncated=st.truncated | start)
    return new, tok, forced, done


class Step(NamedTuple):
    """What one iteration's bookkeeping hands the forward and the host."""

    state: RowState
    """After this token: rows that ended are inactive, the others one column longer."""
    tokens: torch.Tensor
    """(S,) this step's tokens (forced ones substituted): the forward's input."""
    record: torch.Tensor
    """(S, 5) int64 `RECORD_FIELDS` for the host."""
    write_col: torch.Tensor
    """(S,) where each row's new K/V go (`scratch_col` for rows not running on)."""
    pos: torch.Tensor
    """(S,) the new token's position."""
    key_len: torch.Tensor
    """(S,) columns each row reads after the write (1 for idle rows: a finite softmax)."""


def advance_and_place_flat(st: tuple[torch.Tensor, ...], tok: torch.Tensor, think: tuple[Any, ...],
                           scratch_col: int) -> tuple[Any, ...]:
    """`advance_and_place` over plain tuples: what goes through torch.compile. Named tuples are rebuilt
    outside the compiled region (`unflatten_step`) - torch 2.11's Dynamo returned a RowState rebuilt from
    `_replace` with missing fields (an IndexError on the next read) where 2.13's does not; plain tuples of
    tensors cross the boundary the same way in every version."""
    step = advance_and_place(RowState(*st), tok, ThinkTokens(*think), scratch_col)
    return (tuple(step.state),) + tuple(step[1:])


def unflatten_step(flat: tuple[Any, ...]) -> "Step":
    return Step(RowState(*flat[0]), *flat[1:])


def advance_and_place(st: RowState, tok: torch.Tensor, think: ThinkTokens, scratch_col: int) -> Step:
    """`advance_rows`, the host record, and where the surviving rows' tokens go in the cache: everything of
    an iteration between sampling and the forward, as one pure function (compiled into a few fused kernels
    with the decode step)."""
    st, tok, forced, done = advance_rows(st, tok, think)
    rec = torch.stack([tok, done.long(), forced.long(), st.think_tokens, st.truncated.long()], dim=1)
    nxt = st.active & ~done
    write_col = torch.where(nxt, st.length, scratch_col)
    pos = st.offset + st.length
    length = st.length + nxt.long()
    key_len = torch.where(nxt, length, 1)
    return Step(st._replace(active=nxt, length=length), tok, rec, write_col, pos, key_len)
