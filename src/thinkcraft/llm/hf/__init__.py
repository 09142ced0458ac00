"""`hf` engine: transformers in-process (bf16 on GPU, fp32 on CPU).

Hidden states (`prefill.py`): batched with right padding and a last-real-token gather, any layer (0 =
embeddings, L or -1 = final-normed output, what the LM head reads), "last" or "mean" pooling over the
item's own tokens. With a shared prefix, the prefix is prefilled once (batch 1) and its per-layer KV kept
while it is unchanged; the suffixes then run through the decoder layers with cascade attention
(`attention.shared_prefix_attention`) that reads that one copy of the prefix KV. The plain path (prefix +
item as one sequence, HF forward) is kept as the reference and is tested allclose.

Generation (`decode.py`): own decode loop over the HF model (token-in/token-out) with temperature / top-p,
stop strings, max tokens, n samples per item, sampled-token logprobs (unmodified softmax), seeds, and a
thinking budget for `<think>` models. KV cache: dynamic, or static with optional `torch.compile` of the
decode step (CUDA graphs); a shared prefix's KV is computed once and copied into every row's cache.

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
