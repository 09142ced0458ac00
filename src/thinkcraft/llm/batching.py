"""Rows of variable length: how a batch is cut into padded forward chunks, padded, and read back.

Rows are sorted by length; a chunk is a contiguous run of the sorted rows, right-padded to its longest.
One chunk wastes the padding (ppo-hidden's compact texts run 57-153 tokens: a third of a single padded
batch is padding); many chunks waste launches and small, slow matmuls. `plan_chunks` picks the cut points
that minimise  sum over chunks of (rows x longest) + overhead_tokens  (a dynamic programme over the
points where the length crosses a multiple of `quantum` tokens - exact with quantum 1), within the
per-chunk limits on padded tokens and rows. `pad_rows` lays the rows out, `take_rows` reads one position
per row back. `encode_text` / `tokenize_batch` turn a protocol Batch into token ids with a tokenizer (the hf
engine's rule, shared by engines that tokenize on the caller's side: pools/ray_features.py).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
import torch

from thinkcraft.llm.protocol import Batch
from thinkcraft.utils.errors import UserError


def encode_text(tokenizer, text: str, first: bool) -> list[int]:  # noqa: ANN001
    """Token ids of `text`; the tokenizer's special tokens (BOS...) only at the very start of a sequence
    (`first`), and not when the text already starts with BOS (a chat template wrote it)."""
    bos = getattr(tokenizer, "bos_token", None)
    special = first and not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def tokenize_batch(tokenizer, batch: Batch) -> tuple[list[int], list[list[int]]]:  # noqa: ANN001
    """(prefix ids, item ids). Texts: prefix and items are tokenized separately and concatenated as token ids
    (so the prefix KV is reusable); the first piece gets the tokenizer's special tokens. Token-id batches
    pass through as ints."""
    if len(batch) == 0:
        return [], []
    if batch.is_tokens:
        prefix = [int(t) for t in batch.prefix] if batch.prefix is not None else []
        return prefix, [[int(t) for t in it] for it in batch.items]
    if batch.prefix is not None and not isinstance(batch.prefix, str):
        raise UserError("a text batch needs a text prefix (got token ids)")
    prefix = encode_text(tokenizer, batch.prefix, first=True) if batch.prefix else []
    return prefix, [encode_text(tokenizer, t, first=not prefix) for t in batch.items]


def plan_chunks(
    sorted_lengths: Sequence[int], overhead_tokens: int, max_tokens: int, max_rows: int, quantum: int = 8
) -> list[tuple[int, int]]:
    """[(start, end), ...] covering range(len(sorted_lengths)) in order. `sorted_lengths` must be
    non-decreasing. A chunk exceeds `max_tokens` only when one row alone does (that row gets its own).
    Cuts are considered where the length crosses a multiple of `quantum` tokens (quantum 1: wherever it
    changes - the exact optimum; 8, the default, is within 7 padded tokens per row of it and plans a
    refresh of 128 rows in a fraction of the time: this runs on every ppo-hidden refresh)."""
    L = np.asarray(sorted_lengths, dtype=np.int64)
    n = len(L)
    if n == 0:
        return []
    if np.any(np.diff(L) < 0):
        raise ValueError("plan_chunks needs lengths sorted in non-decreasing order")
    if max_rows < 1 or max_tokens < 1 or overhead_tokens < 0 or quantum < 1:
        raise ValueError("max_rows, max_tokens and quantum must be >= 1, overhead_tokens >= 0")
    # Cut candidates: where the length (in quanta) changes - cutting inside a run of equal lengths saves no
    # padding - plus a regular grid, as coarse as the row/token limits allow, so that they can be met.
    step = max(1, min(max_rows, max_tokens // max(int(L[-1]), 1), max(8, n // 16)))
    cand = np.union1d(np.flatnonzero(np.diff((L + quantum - 1) // quantum)) + 1, np.arange(0, n + 1, step))
    cand = np.union1d(cand, [0, n])
    best = np.full(len(cand), np.inf)
    prev = np.zeros(len(cand), dtype=np.int64)
    best[0] = 0.0
    for j in range(1, len(cand)):
        end = cand[j]
        rows = end - cand[:j]
        padded = rows * L[end - 1]
        ok = (padded <= max_tokens) & (rows <= max_rows)
        ok[j - 1] = True  # the shortest chunk ending here is always allowed (a lone over-long row)
        cost = np.where(ok, best[:j] + padded + overhead_tokens, np.inf)
        i = int(np.argmin(cost))
        best[j], prev[j] = cost[i], i
    out: list[tuple[int, int]] = []
    j = len(cand) - 1
    while j > 0:
        i = int(prev[j])
        out.append((int(cand[i]), int(cand[j])))
        j = i
    return out[::-1]


def pad_rows(seqs: Sequence[Sequence[int]], side: str, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) int64 (B, T) of the rows padded with `pad_id` to the longest, on the `side` ("left" or
    "right"); mask 1 = a real token. Built in numpy: one host->device copy each, this runs once per forward
    chunk (every ppo-hidden refresh)."""
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    t = int(lens.max())
    col = np.arange(t)[None, :]
    mask = col < lens[:, None] if side == "right" else col >= (t - lens)[:, None]
    ids = np.full((len(seqs), t), pad_id, dtype=np.int64)
    ids[mask] = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lens.sum()))
    return ids, mask.astype(np.int64)


def take_rows(h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(B, T, H) -> (B, H): row b's hidden state at position pos[b]."""
    return h[torch.arange(h.shape[0], device=h.device), pos]
