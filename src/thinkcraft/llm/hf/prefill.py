"""Hidden states: the plain path, the cascade path over a cached shared-prefix KV, chunking, pooling.

Rows are cut into forward chunks by `batching.plan_chunks` (length-sorted, padding traded against
launches), right-padded (causal attention keeps pads after the real tokens out of view, so no mask is
needed) and run through the decoder layers one by one (`compat.call_layer`, compiled on CUDA for a frozen
model). With a shared prefix, the prefix is prefilled once (batch 1) and its per-layer KV cached while it
and the weights are unchanged; the suffixes then attend to that one copy through the cascade attention
(`attention.shared_prefix_attention`). The plain path (prefix + item as one sequence) is the reference,
tested allclose. A "last" read of layer L runs that layer's MLP on each row's last token only
(`compat.splits_at_mlp` layers).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Iterator, Literal, Sequence

import numpy as np
import torch

from thinkcraft.llm import compat
from thinkcraft.llm.attention import probe_gqa_native, probe_varlen, register_cascade_attention
from thinkcraft.llm.batching import plan_chunks, take_rows
from thinkcraft.llm.hf.hidden_graphs import HiddenGraphs, hidden_graphs_on
from thinkcraft.llm.protocol import Batch
from thinkcraft.llm.quant import check_fp8_device, quantize_fp8_
from thinkcraft.utils.errors import UserError
from thinkcraft.utils.fallback import compiled_or_eager
from thinkcraft.utils.transfer import to_device

log = logging.getLogger(__name__)

Pooling = Literal["last", "mean"]


def pool(h: torch.Tensor, start: torch.Tensor, end: torch.Tensor, pooling: str) -> torch.Tensor:
    """Pool h (B, T, H) over positions [start, end) per row: the last one, or the mean; float32."""
    if pooling == "last":
        return take_rows(h, end - 1).float()
    pos = torch.arange(h.shape[1], device=h.device)[None, :]
    w = ((pos >= start[:, None]) & (pos < end[:, None])).to(torch.float32)
    return torch.einsum("bt,bth->bh", w, h.float()) / w.sum(1, keepdim=True)


class PrefillMixin:
    """`HFEngine`'s hidden-state half. Reads the engine's model facts (`_lm`, `_dec`, `device`, `num_layers`,
    `hidden_size`, `pad_id`, `_cache_kw`, `_weight_update`) and its contexts (`_inference`, `_attn_impl`)."""

    def _init_prefill(
        self, max_batch_tokens: int | None, max_batch_size: int, prefix_reuse: bool, prefix_cache_size: int,
        compile_prefill: bool | None, chunk_overhead_tokens: int, quantize: str,
    ) -> None:
        self.max_batch_tokens = max_batch_tokens or (65536 if self.device.type == "cuda" else 8192)
        self.max_batch_size = max_batch_size
        self.chunk_overhead_tokens = chunk_overhead_tokens
        """Padding tokens a hidden-state forward chunk must save to be worth its own launch (batching.py)."""
        self.prefix_reuse = prefix_reuse
        self._prefix_cache: OrderedDict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._prefix_cache_size = prefix_cache_size
        # Hidden-state prefill through torch.compile'd decoder layers (one compiled graph shared by every
        # layer, dynamic batch/length): fuses the norms, RoPE, SiLU and the cascade merge that otherwise
        # cost as much GPU time as the matmuls. Default: on for a frozen model (no parameter requires grad)
        # on CUDA; off for a model being trained (its compiled graphs would guard on changing weights).
        self._frozen = not any(q.requires_grad for q in self._lm.parameters())
        if compile_prefill is None:
            compile_prefill = self.device.type == "cuda" and self._frozen
        self.compile_prefill = compile_prefill
        self.quantize = quantize
        if quantize == "fp8":
            # decoder linears only (embeddings and the LM head stay): the prefill's matmuls on FP8 cores
            check_fp8_device(self.device)
            quantize_fp8_(self._dec.layers)
        # one compiled graph serves every layer (dynamic shapes; the layer's weights are graph inputs); eager, once
        # and with a warning, if compiling fails (no Triton / no C++ compiler)
        self._layer_fn: Any = (compiled_or_eager(compat.call_layer, "prefill", log, dynamic=True) if compile_prefill
                               else compat.call_layer)
        self._cascade_name = register_cascade_attention()
        # kernel choices decided here, eagerly: the compiled layers then only read the answers
        probe_gqa_native(self.device)
        probe_varlen(self.device)

    def _layer_index(self, layer: int) -> int:
        n = self.num_layers
        if not -(n + 1) <= layer <= n:
            raise UserError(f"layer {layer} out of range for a {n}-layer model (use 0..{n} or -1..-{n + 1})")
        return layer if layer >= 0 else n + 1 + layer

    def hidden_states(self, batch: Batch, layer: int = -1, pooling: Pooling = "last") -> np.ndarray:
        return self.hidden_states_torch(batch, layer, pooling).cpu().numpy()

    def hidden_states_torch(
        self,
        batch: Batch,
        layer: int = -1,
        pooling: Pooling = "last",
        prefix_reuse: bool | None = None,
        padding_side: Literal["left", "right"] = "right",
    ) -> torch.Tensor:
        """(N, H) float32 tensor on the model's device (hand to JAX with `dlpack.torch_to_jax`).
        `prefix_reuse=False` forces the plain path (prefix + item as one sequence) - the reference."""
        if pooling not in ("last", "mean"):
            raise UserError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        idx = self._layer_index(layer)
        prefix, items = self.tokenize_batch(batch)
        if not items:
            return torch.zeros((0, self.hidden_size), dtype=torch.float32, device=self.device)
        if any(len(it) == 0 for it in items) and (pooling == "mean" or not prefix):
            raise UserError("every item needs at least one token (empty item in the batch)")
        reuse = self.prefix_reuse if prefix_reuse is None else prefix_reuse
        with self._inference() as caller:
            out = torch.empty((len(items), self.hidden_size), dtype=torch.float32, device=self.device)
            if reuse and prefix and all(len(it) > 0 for it in items):
                kv = self._prefix_kv(prefix)
                graphs = self._hidden_graphs() if pooling == "last" else None
                for rows in self._chunks([len(it) for it in items]):
                    sel = [items[i] for i in rows]
                    h = graphs.run(sel, len(prefix), kv, idx) if graphs is not None else None
                    out[to_device(rows, self.device)] = (
                        h if h is not None else self._pooled_cascade(sel, len(prefix), kv, idx, pooling))
            else:
                seqs = [prefix + it for it in items]
                for rows in self._chunks([len(s) for s in seqs]):
                    out[to_device(rows, self.device)] = self._pooled_plain(
                        [seqs[i] for i in rows], [len(items[i]) for i in rows], idx, pooling, padding_side
                    )
            if caller is not None:
                out.record_stream(caller)  # allocated on the partition's stream, read on the caller's
        return out

    def token_hidden_states(self, token_ids: Sequence[int], layer: int = -1) -> torch.Tensor:
        """(T, H) float32 per-token hidden states of one sequence (what SGLang's /generate returns)."""
        idx = self._layer_index(layer)
        with self._inference():
            ids, mask = self._pad([list(token_ids)], "right")
            return self._run_decoder(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), idx)[0].float()

    def _chunks(self, lengths: Sequence[int]) -> Iterator[np.ndarray]:
        """Row index groups (host arrays) of length-sorted rows, cut where the padding saved pays for another
        forward (batching.plan_chunks), each ≤ max_batch_tokens padded tokens and ≤ max_batch_size rows. (Host
        indices: picking the rows' items with device indices read each index back, one sync per row.)"""
        order = np.argsort(np.asarray(lengths), kind="stable")
        sorted_lengths = np.asarray(lengths)[order]
        for a, b in plan_chunks(sorted_lengths, self.chunk_overhead_tokens, self.max_batch_tokens, self.max_batch_size):
            yield order[a:b]

    def _hidden_graphs(self) -> HiddenGraphs | None:
        """This engine's hidden-state graphs (hidden_graphs.py) when they may serve it: THINKCRAFT_HIDDEN_GRAPHS=1,
        a frozen model (no parameter requires grad: a feature engine's) on CUDA, no SM partition; else None (the
        compiled layers)."""
        if self.device.type != "cuda" or not self._frozen or self._sm is not None or not hidden_graphs_on():
            return None
        if getattr(self, "_graphs", None) is None:
            self._graphs = HiddenGraphs(self._layers_pooled, self.device, self.pad_id)
        return self._graphs

    def _pooled_plain(
        self, seqs: list[list[int]], item_lens: list[int], idx: int, pooling: str, side: str
    ) -> torch.Tensor:
        lens = torch.tensor([len(s) for s in seqs], device=self.device)
        ilens = torch.tensor(item_lens, device=self.device)
        if side == "right":
            # Right padding + causal attention is exact for every real token (pads come after them):
            # no mask needed, so the same (compiled) layer loop as the cascade path runs it.
            ids, _ = self._pad(seqs, "right")
            return self._layers_pooled(ids, torch.zeros_like(lens[:1]), idx, None, lens - ilens, lens, pooling)
        ids, mask = self._pad(seqs, side)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        h = self._run_decoder(ids, mask, pos, idx)
        end = torch.full_like(lens, ids.shape[1])
        return pool(h, end - ilens, end, pooling)

    def _pooled_cascade(self, items: list[list[int]], p: int, kv: list, idx: int, pooling: str) -> torch.Tensor:
        ids, _ = self._pad(items, "right")
        end = torch.tensor([len(it) for it in items], device=self.device)
        return self._layers_pooled(ids, torch.tensor([p], device=self.device), idx, kv, torch.zeros_like(end), end, pooling)

    def _run_decoder(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, idx: int) -> torch.Tensor:
        """HF's own decoder forward (masked; the left-padded reference and per-token reads)."""
        want_all = idx != self.num_layers
        out = self._dec(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, output_hidden_states=want_all)
        return out.hidden_states[idx] if want_all else out.last_hidden_state

    def _layers(
        self, ids: torch.Tensor, start: torch.Tensor, idx: int, kv: list | None, last: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states after `idx` layers (idx = num_layers: after the final norm) of right-padded rows
        whose positions start at `start` (the prefix length), causal within the rows; with `kv` each layer
        also attends to the shared prefix KV (cascade attention). (B, S, H); with `last` ((B,) one position
        per row) only those tokens, (B, H), and the last layer's MLP runs on them alone."""
        b, s = ids.shape
        dec = self._dec
        h = dec.embed_tokens(ids)
        if idx == 0:
            return h if last is None else take_rows(h, last)
        pos = (start + torch.arange(s, device=self.device))[None, :].expand(b, s)
        pe = compat.rotary(dec, h, pos)
        layers = dec.layers[: min(idx, self.num_layers)]
        split = last is not None and compat.splits_at_mlp(layers[-1])
        with self._attn_impl(self._cascade_name):
            for i, layer in enumerate(layers):
                pkv = kv[i] if kv is not None else None
                if split and i == len(layers) - 1:
                    h = self._layer_fn(layer, h, pos, pe, pkv, last)
                else:
                    h = self._layer_fn(layer, h, pos, pe, pkv)
        if last is not None and not split:
            h = take_rows(h, last)
        return dec.norm(h) if idx == self.num_layers else h

    def _layers_pooled(
        self, ids: torch.Tensor, start: torch.Tensor, idx: int, kv: list | None, begin: torch.Tensor, end: torch.Tensor,
        pooling: str,
    ) -> torch.Tensor:
        """`_layers` pooled over each row's positions [begin, end), (B, H) float32: a last-token read
        passes the positions down (the read layer's MLP then runs on those tokens alone)."""
        if pooling == "last":
            return self._layers(ids, start, idx, kv, last=end - 1).float()
        return pool(self._layers(ids, start, idx, kv), begin, end, pooling)

    def _weights_version(self) -> int:
        """Changes whenever a parameter is modified in place (optimizer steps, load_state_dict), so a
        learner-shared model never reads prefix KV computed with older weights. Frozen engines: 0."""
        if not self._weight_update:
            return 0
        return compat.weights_version(self._lm.parameters())

    def _prefix_forward(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k, v) of the (1, P) prefix `ids` under the current weights, uncached (what `_prefix_kv`
        caches, and what the continuous batcher's prefix graph captures: prefix_graph.py)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self._lm.config)
        self._dec(input_ids=ids, use_cache=True, **{self._cache_kw: cache})
        return compat.cache_kv(cache)

    def _prefix_kv(self, prefix: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k, v) of the prefix, (1, Hkv, P, d) each, RoPE'd at positions 0..P-1; cached (LRU of
        `prefix_cache_size`, keyed by the weights' version and the prefix ids). The decode reuses it too."""
        key = (self._weights_version(), *prefix)
        if key in self._prefix_cache:
            self._prefix_cache.move_to_end(key)
            return self._prefix_cache[key]
        kv = self._prefix_forward(torch.tensor([prefix], dtype=torch.long, device=self.device))
        self._prefix_cache[key] = kv
        while len(self._prefix_cache) > self._prefix_cache_size:
            self._prefix_cache.popitem(last=False)
        return kv
