"""Policy model, tokenizer and the in-process engine that samples from the learner's own weights."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence


from thinkcraft.utils.errors import ConfigError, UserError
from thinkcraft.train.llm_policy.config import ALGOS_NEEDING_LOGPROBS, MODEL_SHAPES, LLMPolicyConfig


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

THINKING_CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}<think>\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
"""ChatML where every assistant turn opens a thought: the prompt ends inside `<think>` (the thinking budget
counts from there) and earlier replies are rendered exactly as sampled (append-only: turn-KV reuse)."""


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int = 2048, thinking: bool = False):
    """A byte-level BPE (HF `tokenizers`) trained on `texts`, with ChatML special tokens and template; with
    `thinking`, `<think>` / `</think>` as single (ordinary, decoded) tokens and `THINKING_CHATML_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        additional_special_tokens=specials[1:],
    )
    fast.chat_template = CHATML_TEMPLATE
    if thinking:
        fast.add_tokens(["<think>", "</think>"])
        fast.chat_template = THINKING_CHATML_TEMPLATE
    return fast

def random_model(shape: str, tokenizer=None, seed: int = 0, vocab_size: int | None = None):
    """A causal LM with random weights in the named shape (Qwen2 architecture, or the shape's `arch`), its
    vocabulary the tokenizer's, or `vocab_size` ids (`config.REAL_VOCAB`: a learner fed synthetic token ids
    needs no tokenizer)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if shape not in MODEL_SHAPES:
        raise UserError(f"unknown model shape {shape!r}; known: {', '.join(MODEL_SHAPES)}")
    kw = dict(MODEL_SHAPES[shape])
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        kw.pop("arch", "qwen2")]
    cfg = config_cls(
        vocab_size=vocab_size or len(tokenizer), max_position_embeddings=32768,
        eos_token_id=tokenizer.eos_token_id if tokenizer is not None else 0,
        pad_token_id=tokenizer.pad_token_id if tokenizer is not None else 0, bos_token_id=None, **kw,
    )
    torch.manual_seed(seed)
    return model_cls(cfg)

def resolve_model_path(spec: str) -> Path:
    """'default' (the bundled model, converted once), a .gguf file or a local HF folder; never downloads."""
    from thinkcraft.llm.models import resolve_model

    return Path(resolve_model(spec))

def load_policy(cfg: LLMPolicyConfig, prompt_texts: Sequence[str], device, dtype):
    """(model, tokenizer) for the policy: pretrained from a folder or random weights in a named shape."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = cfg.model_spec
    if spec.scheme == "random":
        tok = train_bpe_tokenizer(prompt_texts, thinking=cfg.thinking_budget is not None)
        model = random_model(spec.target, tok, seed=cfg.seed)
        model.to(device=device, dtype=dtype)
    else:
        path = resolve_model_path(spec.target)
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        tok.chat_template = CHATML_TEMPLATE
    model.config.use_cache = True
    return trainable(model, cfg), tok


def trainable(model, cfg: LLMPolicyConfig):
    """The model as the learner trains it: LoRA adapters on every linear layer (`--finetune lora`), or fp32
    master weights (`full`, bf16 autocast for the forward)."""
    import torch

    if cfg.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                          task_type="CAUSAL_LM")
        torch.manual_seed(cfg.seed)
        # PEFT keeps adapter weights in fp32 even when the base is bf16 (autocast_adapter_dtype)
        with warnings.catch_warnings():  # PEFT reads transformers' deprecated `is_gradient_checkpointing` (v5)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return get_peft_model(model, lcfg)
    return model.float()


# =========================================================================================== sampler

def decode_path(device_type: str, kv_cache: str = "auto", compile_decode: bool | None = None) -> tuple[str, bool]:
    """(kv_cache, compile_decode) for the engine: the fastest path the device supports unless forced - a
    compiled CUDA-graph step over the static width on CUDA, the eager step with a dynamic width elsewhere."""
    compiled = device_type == "cuda" if compile_decode is None else bool(compile_decode)
    width = ("static" if compiled else "dynamic") if kv_cache == "auto" else kv_cache
    return width, compiled


def make_engine(model, tokenizer, cfg: "LLMPolicyConfig"):
    """The in-process engine over the learner's model: `HFEngine.from_model` shares the parameters (no
    copy), so every rollout samples from the weights the learner just updated."""
    from thinkcraft.llm.hf import HFEngine

    device = next(model.parameters()).device
    kv_cache, compiled = decode_path(device.type, cfg.kv_cache, cfg.compile_decode)
    return HFEngine.from_model(model, tokenizer, kv_cache=kv_cache, compile_decode=compiled,
                               max_batch_size=cfg.max_generate_batch, kv_cache_gb=cfg.kv_cache_gb)

def check_engine_for_algo(capabilities, algo: str) -> None:
    """Algorithms with a behaviour-policy ratio need the sampled tokens' logprobs from the engine."""
    if algo in ALGOS_NEEDING_LOGPROBS and not capabilities.logprobs:
        raise UserError(
            f"--algo {algo} needs the sampled tokens' logprobs, and this engine returns none; "
            "use an engine with logprobs (hf, vllm, sglang) or --algo apo"
        )
    if not capabilities.generate:
        raise UserError("the policy engine cannot generate text")


# =========================================================================================== rollout

def _device(spec: str, flag: str = "device"):
    import torch

    # "auto": the first visible GPU by name, never the thread's current one - something else in the process (JAX's
    # GPU client starting, an earlier run's engine) may have left another GPU current (2 x H200, 2026-11-29: a
    # learner meant for cuda:0 went to cuda:1, its engine's GPU)
    d = torch.device(("cuda:0" if torch.cuda.is_available() else "cpu") if spec == "auto" else spec)
    if d.type == "cuda" and not torch.cuda.is_available():
        hint = "use --device cpu or auto" if flag == "device" else f"{spec!r} names a GPU (use cpu)"
        raise ConfigError(flag, f"CUDA is not available on this machine; {hint}")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ConfigError(flag, f"{spec!r}: this machine has {n} GPU(s) (cuda:0..cuda:{n - 1})")
    if d.type == "cuda" and d.index is None:
        # "cuda" names the *calling thread's* current GPU: the pools create tensors on the learner's device from
        # their own threads, and an engine on cuda:1 may make that GPU current in one of them; one index, fixed
        # here (on the main thread), keeps the learner's weights and its rows on one GPU
        d = torch.device("cuda", torch.cuda.current_device())
    return d

class _AdapterOffEngine:
    """The policy's own weights with the LoRA adapter switched off (the initial model) as a judge."""

    def __init__(self, inner, model) -> None:
        self.inner, self.model = inner, model

    @property
    def capabilities(self):
        return self.inner.capabilities

    def generate(self, batch, sampling):
        import contextlib

        ctx = self.model.disable_adapter() if hasattr(self.model, "disable_adapter") else contextlib.nullcontext()
        with ctx:
            return self.inner.generate(batch, sampling)

    def hidden_states(self, *a, **k):
        return self.inner.hidden_states(*a, **k)

    def close(self) -> None:
        pass


def make_judge(cfg: LLMPolicyConfig, model, tokenizer, engine):
    """(judge engine, prompt format) for `--reward judge`: another engine from its spec, or 'self' - the
    policy's own weights with the LoRA adapter off (the initial model)."""
    def msgs(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    if cfg.judge_engine != "self":
        from thinkcraft.llm import make_engine as make_engine_from_spec

        judge = make_engine_from_spec(cfg.judge_engine, **cfg.judge_engine_options())
        if judge.capabilities.tokenizer:  # in-process engines: their own chat template
            return judge, lambda text: judge.apply_chat_template(msgs(text))
        return judge, None  # HTTP engines receive the plain prompt

    def fmt(text: str) -> str:
        return tokenizer.apply_chat_template(msgs(text), add_generation_prompt=True, tokenize=False)

    return _AdapterOffEngine(engine, model), fmt
