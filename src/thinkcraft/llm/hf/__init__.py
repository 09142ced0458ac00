"""`hf` engine: transformers in-process (bf16 on GPU, fp32 on CPU).

Hidden states (`prefill.py`): batched with right padding and a last-real-token gather, any layer (0 =
embeddings, L or -1 = final-normed output, what the LM head reads), "last" or "mean" pooling over the
item's own tokens. With a shared prefix, the prefix is prefilled once (batch 1) and its per-layer KV kept
while it is unchanged; the suffixes then run through the decoder layers with cascade attention
(`attention.shared_prefix_attention`) that reads that one copy of the prefix KV. The plain path (prefix +
item as one sequence, HF forward) is kept as the reference and is tested allclose.

Generation (`decode.py`, `batcher.py`): continuous batching over a slot KV cache - `submit` / `step` / `poll`
(or the engine's own thread), `generate` as a wrapper; requests join the running batch at step boundaries and
leave it when they end. Per-row temperature / top-p, stop strings, max tokens, n samples, sampled-token
logprobs (unmodified softmax), seeds, a thinking budget enforced on the device in the same sequence (`rows.py`).
The slots (`slots.py`): per-layer (S, Hkv, T + 1, d) buffers, the shared prefix stored once and read by every
row through a log-sum-exp merge, new tokens prefilled packed (FlashAttention varlen on CUDA), the one-token
step over all slots with fixed shapes (eager, or torch.compile + CUDA graphs). Which slot holds what - free,
running, parked for an episode's next turn - and the eviction policy: `slot_table.py`. Allocation within the
KV budget and the forward passes: `cache.py`; one iteration (admit, launch, collect, finish): `iteration.py`.
Versioned weight updates at step boundaries: `weights.py`.

The façade (`engine.py`): construction, capabilities, tokenization, chat template, SM limit, per-call
contexts. Every reach into transformers/torch internals: `thinkcraft.llm.compat`.

Works on any Llama/Qwen-style decoder (embed_tokens, layers, norm, rotary_emb), including a PEFT
(LoRA) wrapped model shared with a learner: `HFEngine.from_model(model, tokenizer)` copies nothing.
"""

from thinkcraft.llm.batching import take_rows
from thinkcraft.llm.compat import call_layer, splits_at_mlp
from thinkcraft.llm.hf.decode import top_p_filter
from thinkcraft.llm.hf.engine import HFEngine
from thinkcraft.llm.hf.prefill import Pooling

__all__ = ["HFEngine", "Pooling", "call_layer", "splits_at_mlp", "take_rows", "top_p_filter"]
