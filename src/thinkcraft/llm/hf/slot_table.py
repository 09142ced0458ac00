"""Which slot of the KV cache holds what (host side, no tensors): free, running a request, or parked - an
episode's KV kept between its turns - and the eviction policy that frees a parked slot when a request needs
one and none is free.

A parked slot remembers the token sequence its KV covers (`tokens`, shared prefix included), the prefix
length its columns start after (`offset`) and the weight version that computed it. `reuse_len` compares an
episode's next prompt with that sequence token by token: the KV of the common prefix is kept, the rest is
recomputed. A prompt that does not extend the sequence (a chat template that rewrites earlier turns, e.g.
Qwen3 dropping earlier thoughts) is a *fallback*: counted by the caller, never a silent mismatch.
"""

from __future__ import annotations

from typing import Hashable, Literal

import numpy as np

FREE, RUNNING, PARKED = 0, 1, 2
EvictPolicy = Literal["oldest", "longest"]


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays (vectorised: no Python loop per token)."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class SlotTable:
    def __init__(self, slots: int, evict: EvictPolicy = "oldest") -> None:
        if evict not in ("oldest", "longest"):
            raise ValueError(f"evict must be 'oldest' or 'longest', got {evict!r}")
        self.evict = evict
        self.status = np.full(slots, FREE, dtype=np.int8)
        self.episode: list[Hashable | None] = [None] * slots
        self.tokens: list[np.ndarray | None] = [None] * slots
        self.token_lists: list[list[int] | None] = [None] * slots
        """The same ids as `tokens` as a list, where `park` was given one (`Batcher.submit`'s fast path)."""
        self.offset = np.zeros(slots, dtype=np.int64)
        self.version = np.zeros(slots, dtype=np.int64)
        self.parked_at = np.zeros(slots, dtype=np.int64)
        self._by_episode: dict[Hashable, int] = {}
        self._clock = 0
        self.evictions = 0
        """Parked episodes whose KV was dropped to make room for another request."""

    def __len__(self) -> int:
        return len(self.status)

    def parked(self, episode: Hashable | None) -> int | None:
        """The slot parked for `episode`, if any."""
        if episode is None:
            return None
        s = self._by_episode.get(episode)
        return s if s is not None and self.status[s] == PARKED else None

    def take(self, episode: Hashable | None) -> int | None:
        """A slot for a request of `episode`: its own parked slot, else a free one, else another episode's
        parked slot by the eviction policy (counted); None when every slot runs a request."""
        own = self.parked(episode)
        if own is not None:
            return own
        free = np.flatnonzero(self.status == FREE)
        if len(free):
            return int(free[0])
        parked = np.flatnonzero(self.status == PARKED)
        if not len(parked):
            return None
        if self.evict == "oldest":
            s = int(parked[np.argmin(self.parked_at[parked])])
        else:
            s = int(parked[np.argmax([len(self.tokens[i]) for i in parked])])
        self.free(s)
        self.evictions += 1
        return s

    def run(self, slot: int, episode: Hashable | None, offset: int) -> None:
        """The slot runs a request of `episode` whose columns start after a shared prefix of `offset` tokens."""
        self._unlink(slot)
        self.status[slot] = RUNNING
        self.episode[slot] = episode
        self.tokens[slot] = self.token_lists[slot] = None
        self.offset[slot] = offset
        if episode is not None:
            self._by_episode[episode] = slot

    def park(self, slot: int, tokens: np.ndarray, offset: int, version: int, token_list: list[int] | None = None
             ) -> None:
        """Keep the slot's KV for its episode: it covers `tokens` (prefix included) from column 0 at `offset`
        (`token_list`: the same ids as a list, if the caller has them)."""
        self.status[slot] = PARKED
        self.tokens[slot] = tokens
        self.token_lists[slot] = token_list
        self.offset[slot] = offset
        self.version[slot] = version
        self._clock += 1
        self.parked_at[slot] = self._clock

    def free(self, slot: int) -> None:
        self._unlink(slot)
        self.status[slot] = FREE
        self.episode[slot] = None
        self.tokens[slot] = self.token_lists[slot] = None

    def release(self, episode: Hashable) -> bool:
        """Drop a parked episode's KV (its episode ended); True if it held one."""
        s = self.parked(episode)
        if s is None:
            self._by_episode.pop(episode, None)
            return False
        self.free(s)
        return True

    def drop_parked(self) -> int:
        """Free every parked slot (their KV came from weights that changed); how many."""
        parked = np.flatnonzero(self.status == PARKED)
        for s in parked:
            self.free(int(s))
        return len(parked)

    def uses_prefix(self) -> bool:
        """Does a running or parked slot read the shared prefix (columns after an offset)?"""
        return bool(np.any((self.status != FREE) & (self.offset > 0)))

    def adopt(self, old: "SlotTable") -> None:
        """Take over a smaller table's parked slots (the cache grew; slot indices are kept)."""
        n = min(len(old), len(self))
        for s in np.flatnonzero(old.status[:n] == PARKED):
            s = int(s)
            self.status[s], self.episode[s], self.tokens[s] = PARKED, old.episode[s], old.tokens[s]
            self.token_lists[s] = old.token_lists[s]
            self._by_episode[old.episode[s]] = s
        self.offset[:n], self.version[:n], self.parked_at[:n] = old.offset[:n], old.version[:n], old.parked_at[:n]
        self._clock, self.evictions = old._clock, old.evictions

    def _unlink(self, slot: int) -> None:
        ep = self.episode[slot]
        if ep is not None and self._by_episode.get(ep) == slot:
            del self._by_episode[ep]


def reuse_len(table: SlotTable, slot: int, prompt: np.ndarray, offset: int, version: int) -> tuple[int, bool]:
    """(columns of `slot` to keep, fallback) for a request of the episode parked there: the common token
    prefix of the parked sequence and the prompt, at most all but the prompt's last token (whose logits the
    request needs), in columns after `offset`. Fallback: the prompt does not extend the parked sequence.
    Nothing is kept across another prefix layout or another weight version."""
    tokens = table.tokens[slot]
    if tokens is None or table.version[slot] != version:
        return 0, False
    if table.offset[slot] != offset:  # the prompt no longer starts with the shared prefix the KV sits after
        return 0, True
    lcp = common_prefix_len(tokens, prompt)
    keep = min(lcp, len(prompt) - 1) - offset
    return max(keep, 0), lcp < len(tokens)
