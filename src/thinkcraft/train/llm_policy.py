"""`thinkcraft train llm-policy`: the language model itself is the policy, trained online from env reward.

One synchronous step (each phase timed, `timing/<phase>`):

    1. generate  prompts (chat template, last K turns of history) -> engine.generate (G samples per seed);
                 token ids + sampled-token logprobs kept (token in, token out: never re-tokenized)
    2. env       parse/grade the completions -> per-turn rewards (multi-turn envs loop 1-2 until done)
    3. store     every episode -> trajectory store (token ids, logprobs, masks, rewards, policy_version)
    4. train     returns -> advantages (GRPO / RLOO / REINFORCE) or A*-PO targets -> token loss on generated
                 tokens only, micro-batched with gradient accumulation
    5. log/ckpt  metrics, progress, PNG curve; checkpoint (adapter/weights, optimizer, step, RNG)

The learner owns the torch model; the sampler reads the same parameters (no copy), so after step 4 the
next rollout is on-policy with `policy_version = step`.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np

from thinkcraft.utils.errors import ConfigError, UserError, check

Algo = Literal["grpo", "rloo", "reinforce", "apo"]
EnvName = Literal["arith", "gsm8k", "craftax", "craftax-classic"]
ALGOS_NEEDING_LOGPROBS = ("grpo", "rloo", "reinforce")


@dataclass
class LLMPolicyConfig:
    env: EnvName = "arith"
    """Text environment: arith (generated word problems), gsm8k (local file), craftax, craftax-classic."""
    algo: Algo = "grpo"
    """grpo (group-normalised advantages, clipped ratio), rloo (leave-one-out baseline), reinforce (running-mean
    baseline), apo (A*-PO: offline V* from reference samples, then one sample per prompt)."""
    model: str = "default"
    """'default' (bundled SmolLM2-135M-Instruct), a local HF folder, or random:<shape> (random weights with a
    byte-level BPE trained on the env's prompts; shapes: tiny, qwen2.5-0.5b) for speed measurements."""
    run_dir: str = "runs/llm-policy"
    """Metrics, checkpoints, curve PNG and the trajectory store go here."""
    steps: int = 30
    """Learner steps (one batch of prompts each)."""
    prompts_per_step: int = 8
    """Distinct prompts/seeds per step."""
    group_size: int = 4
    """Samples per prompt (G). A*-PO uses 1 online sample per prompt regardless."""
    max_new_tokens: int = 128
    """Generated tokens per turn at most."""
    temperature: float = 1.0
    """Sampling temperature. Engine and learner logprobs are both at temperature 1 (the engine protocol's
    convention), so ratios compare like with like; T != 1 samples from a sharpened/flattened policy."""
    top_p: float = 1.0
    """Nucleus sampling."""
    thinking_budget: int | None = None
    """For <think> models: close the thought after this many tokens (forced tokens are not trained)."""
    history_turns: int = 2
    """Multi-turn envs: how many past (observation, action) turns the prompt shows."""
    max_turns: int = 8
    """Craftax: decisions per episode (the episode step cap)."""
    format_penalty: float = 0.0
    """Craftax: reward subtracted when the action cannot be parsed (a no-op is played)."""
    difficulty: int = 1
    """arith: difficulty level 1..6."""
    gsm8k_path: str | None = None
    """gsm8k: local JSONL/Parquet in the GSM8K layout (question, answer ending in '#### <n>')."""
    reward: Literal["rule", "judge"] = "rule"
    """arith/gsm8k reward: rule (`#### <number>` exact match) or judge (an LLM compares gold and answer)."""
    judge_engine: str = "self"
    """Judge engine: 'self' (the policy's weights with the LoRA adapter off) or any engine spec
    (hf:<path-or-default>, vllm:<path>, sglang+http://host:port, openai+http://host:port/v1)."""
    answer_weight: float = 1.0
    """Reward for a correct final answer."""
    lenient_answer: bool = False
    """Rule reward: without a `####` line, grade the last number in the text (denser signal for small models)."""
    format_weight: float = 0.1
    """Reward for a parsable `#### <number>` line (a learning signal before answers are right)."""
    finetune: Literal["lora", "full"] = "lora"
    """LoRA adapters through PEFT (default) or full fine-tuning."""
    lora_rank: int = 16
    """LoRA rank r."""
    lora_alpha: float = 32.0
    """LoRA scaling alpha."""
    lr: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping (0 = off)."""
    micro_batch_size: int = 8
    """Rows (turns) per forward/backward; gradients accumulate over the batch."""
    clip_eps: float = 0.2
    """PPO/GRPO ratio clip."""
    kl_coef: float = 0.0
    """k3 KL penalty to the reference (initial) policy; 0 = none (as DAPO/Dr. GRPO)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "seq-mean-token-mean"
    """How token losses are averaged (GRPO's per-sequence mean, or every token equal)."""
    scale_adv_by_std: bool = True
    """GRPO: divide by the group std (False = Dr. GRPO)."""
    gamma: float = 1.0
    """Multi-turn discount for returns-to-go."""
    baseline_momentum: float = 0.9
    """REINFORCE: EMA momentum of the reward baseline."""
    apo_ref_samples: int = 8
    """A*-PO: reference samples per prompt for the offline V* estimate."""
    apo_beta1: float = 0.5
    """A*-PO: V* = β1 log mean exp(r/β1)."""
    apo_beta2: float = 1e-3
    """A*-PO: regression weight of log πθ/πref."""
    apo_pool_size: int = 64
    """A*-PO: prompts (seeds) in the training pool whose V* is estimated offline."""
    kv_cache: Literal["dynamic", "static"] = "dynamic"
    """Engine KV cache during generation; static (+ --compile-decode) lets CUDA graphs replay the decode step."""
    compile_decode: bool = False
    """torch.compile the engine's decode step (GPU; first step pays the compile)."""
    max_generate_batch: int = 1024
    """Sequences per engine decode batch."""
    seed: int = 0
    """Seeds problems, sampling and LoRA init."""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda, cuda:1, ..."""
    bf16: bool = True
    """On GPU: bf16 forward (frozen base weights stored in bf16; trainable weights stay fp32)."""
    checkpoint_every: int = 10
    """Save a checkpoint every N steps (and at the end); 0 = only at the end."""
    resume: bool = False
    """Continue from run_dir/checkpoint.pt (adapter, optimizer, step, RNG, baselines)."""
    store: bool = True
    """Write every episode to run_dir/trajectories (the Parquet trajectory store)."""
    plot: bool = True
    """Write run_dir/curve.png at the end."""
    log_every_s: float = 10.0
    """Progress line interval when not on a terminal."""

    def __post_init__(self) -> None:
        check(self.steps >= 1, "steps", "must be >= 1")
        check(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
        check(self.group_size >= 1, "group_size", "must be >= 1")
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(self.temperature > 0, "temperature", "must be > 0 (sampling; the policy gradient needs samples)")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.history_turns >= 0, "history_turns", "must be >= 0")
        check(self.max_turns >= 1, "max_turns", "must be >= 1")
        check(1 <= self.difficulty <= 6, "difficulty", "must be in 1..6")
        check(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        check(self.lr > 0, "lr", "must be > 0")
        check(self.lora_rank >= 1, "lora_rank", "must be >= 1")
        check(0 <= self.gamma <= 1, "gamma", "must be in [0, 1]")
        check(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0")
        if self.algo in ("grpo", "rloo"):
            check(self.group_size >= 2, "group_size", f"{self.algo} compares samples of one prompt: use >= 2")
        if self.algo == "apo":
            check(self.env in ("arith", "gsm8k"), "algo", "apo (A*-PO) is single-turn: use --env arith or gsm8k")
            check(self.apo_ref_samples >= 1, "apo_ref_samples", "must be >= 1")
            check(self.apo_beta1 > 0 and self.apo_beta2 > 0, "apo_beta1", "apo betas must be > 0")
            check(self.apo_pool_size >= 1, "apo_pool_size", "must be >= 1")
        if self.env == "gsm8k":
            check(bool(self.gsm8k_path), "gsm8k_path", "the gsm8k env needs a local JSONL/Parquet file")
            check(Path(self.gsm8k_path).exists(), "gsm8k_path", f"{self.gsm8k_path} does not exist")
        if self.reward == "judge":
            check(self.env in ("arith", "gsm8k"), "reward", "the judge grades answers of arith/gsm8k, not craftax")
        if self.thinking_budget is not None:
            check(0 < self.thinking_budget < self.max_new_tokens, "thinking_budget", "must be in (0, max_new_tokens)")

    @property
    def is_multi_turn(self) -> bool:
        return self.env in ("craftax", "craftax-classic")

    @property
    def samples_per_prompt(self) -> int:
        return 1 if self.algo == "apo" else self.group_size


# ===================================================================================== model + tokenizer

# Random-weight shapes for speed measurements (`--model random:<shape>`).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, tie_word_embeddings=True),
    # Qwen2.5-0.5B body (ANCHORS.md, TRL reference): 358M parameters with a 2,048-token vocabulary
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, tie_word_embeddings=True, rope_theta=1_000_000.0),
}

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int = 2048):
    """A byte-level BPE (HF `tokenizers`) trained on `texts`, with ChatML special tokens and template."""
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
    return fast


def random_model(shape: str, tokenizer, seed: int = 0):
    """A Qwen2-architecture causal LM with random weights in the named shape."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if shape not in MODEL_SHAPES:
        raise UserError(f"unknown model shape {shape!r}; known: {', '.join(MODEL_SHAPES)}")
    cfg = Qwen2Config(
        vocab_size=len(tokenizer), max_position_embeddings=32768, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **MODEL_SHAPES[shape],
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def resolve_model_path(spec: str) -> Path:
    """'default' (the bundled model, converted once), a .gguf file or a local HF folder; never downloads."""
    from thinkcraft.llm.models import resolve_model

    return Path(resolve_model(spec))


def load_policy(cfg: LLMPolicyConfig, prompt_texts: Sequence[str], device, dtype):
    """(model, tokenizer) for the policy: pretrained from a folder or random weights in a named shape."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.model.startswith("random:"):
        tok = train_bpe_tokenizer(prompt_texts)
        model = random_model(cfg.model.split(":", 1)[1], tok, seed=cfg.seed)
        model.to(device=device, dtype=dtype)
    else:
        path = resolve_model_path(cfg.model)
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        tok.chat_template = CHATML_TEMPLATE
    model.config.use_cache = True
    if cfg.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                          task_type="CAUSAL_LM")
        torch.manual_seed(cfg.seed)
        # PEFT keeps adapter weights in fp32 even when the base is bf16 (autocast_adapter_dtype)
        model = get_peft_model(model, lcfg)
    else:
        model.float()  # full fine-tuning: fp32 master weights, bf16 autocast for the forward
    return model, tok


# =========================================================================================== sampler


def make_engine(model, tokenizer, cfg: "LLMPolicyConfig"):
    """The in-process engine over the learner's model: `HFEngine.from_model` shares the parameters (no
    copy), so every rollout samples from the weights the learner just updated."""
    from thinkcraft.llm.hf import HFEngine

    return HFEngine.from_model(model, tokenizer, kv_cache=cfg.kv_cache, compile_decode=cfg.compile_decode,
                               max_batch_size=cfg.max_generate_batch)


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


@dataclass
class TurnSample:
    obs: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    train_mask: list[int]
    """1 on sampled tokens, 0 on tokens the sampler forced (thinking budget)."""
    text: str
    finish_reason: str
    reward: float = 0.0
    invalid: bool = False
    info: dict = field(default_factory=dict)


@dataclass
class Episode:
    seed: int
    group: int
    turns: list[TurnSample] = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    wall_time_s: float = 0.0

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))


def build_messages(system: str, history: Sequence[tuple[str, str]], obs: str, history_turns: int) -> list[dict]:
    """Chat messages: system, the last K (observation, action) turns, the current observation."""
    msgs = [{"role": "system", "content": system}] if system else []
    for o, a in list(history)[-history_turns:] if history_turns > 0 else []:
        msgs += [{"role": "user", "content": o}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": obs})
    return msgs


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(x) for x in ids]


def rollout(env, engine, tokenizer, seeds: Sequence[int], samples_per_seed: int, sampling, history_turns: int,
            timer=None, gen_context=None) -> list[Episode]:
    """Play one episode per (seed, sample): the G samples of a seed form group `index of the seed`.

    Each turn, the active episodes' prompts go to the engine in one batch; completions keep the engine's
    token ids and logprobs (never re-tokenized).
    """
    import contextlib
    from dataclasses import replace

    phase = timer.phase if timer is not None else (lambda name: contextlib.nullcontext())
    all_seeds = [int(s) for s in seeds for _ in range(samples_per_seed)]
    episodes = [Episode(seed=s, group=i // samples_per_seed) for i, s in enumerate(all_seeds)]
    t0 = time.perf_counter()
    with phase("env"):
        obs = env.reset(all_seeds)
    histories: list[list[tuple[str, str]]] = [[] for _ in episodes]
    sampling = replace(sampling, n=1)
    while True:
        active = env.active_indices()
        if not active:
            break
        with phase("generate"):
            prompts = [encode_prompt(tokenizer, build_messages(env.system_prompt, histories[i], obs[i], history_turns))
                       for i in active]
            with (gen_context() if gen_context is not None else contextlib.nullcontext()):
                comps = engine.generate(_token_batch(prompts), sampling)
        with phase("env"):
            res = env.step([c.text for c in comps])
        for j, i in enumerate(active):
            c = comps[j]
            forced = set(c.forced_token_indices or ())
            episodes[i].turns.append(TurnSample(
                obs=obs[i], prompt_ids=list(c.prompt_token_ids or prompts[j]), completion_ids=list(c.token_ids),
                logprobs=list(c.logprobs) if c.logprobs is not None else [], train_mask=[int(k not in forced) for k in range(len(c.token_ids))],
                text=c.text, finish_reason=str(c.finish_reason), reward=float(res.rewards[j]),
                invalid=bool(res.infos[j].get("invalid", False)), info=res.infos[j],
            ))
            histories[i].append((obs[i], c.text))
            obs[i] = res.observations[j]
            if res.terminated[j] or res.truncated[j]:
                episodes[i].terminated = bool(res.terminated[j])
                episodes[i].truncated = bool(res.truncated[j])
    wall = time.perf_counter() - t0
    for e in episodes:
        e.wall_time_s = wall
    return episodes


def _token_batch(prompts: list[list[int]]):
    from thinkcraft.llm.protocol import Batch

    return Batch(items=prompts)


# ====================================================================================== train batches


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


def save_checkpoint(path: Path, learner: Learner, step: int, extra: dict[str, Any]) -> None:
    import torch

    from thinkcraft.utils.io import atomic_path

    state = {
        "step": step,
        "trainable": learner.trainable_state(),
        "optimizer": learner.optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        "extra": extra,
    }
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: Path, learner: Learner) -> tuple[int, dict[str, Any]]:
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    learner.load_trainable_state(state["trainable"])
    learner.optimizer.load_state_dict(state["optimizer"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return int(state["step"]), state["extra"]


# ============================================================================================ records


def _split_think(text: str) -> tuple[str, str]:
    """(thought, answer) of a `<think>` model's reply; ("", text) when there is no closed thought."""
    head, sep, tail = text.partition("</think>")
    if not sep:
        return "", text
    return head.replace("<think>", "").strip(), tail.strip()


def episode_record(e: Episode, env_name: str, policy_version: int, extra: dict[str, Any]):
    from thinkcraft.data.schema import TrajectoryMetadata, TrajectoryRecord, Turn

    turns = [
        Turn(think=_split_think(t.text)[0], act=_split_think(t.text)[1], obs=t.obs, reward=t.reward, done=(k == len(e.turns) - 1),
             prompt_token_ids=np.asarray(t.prompt_ids, dtype=np.int32),
             response_token_ids=np.asarray(t.completion_ids, dtype=np.int32),
             logprobs=np.asarray(t.logprobs, dtype=np.float32),
             loss_mask=np.asarray(t.train_mask, dtype=np.int8))
        for k, t in enumerate(e.turns)
    ]
    md = TrajectoryMetadata(env_version=env_name, wall_time=e.wall_time_s, truncated=e.truncated,
                            policy_version=policy_version, seed=e.seed,
                            extra={"group": e.group, "invalid_turns": sum(t.invalid for t in e.turns), **extra})
    return TrajectoryRecord.build(task_id=f"{env_name}/{e.seed}", turns=turns, metadata=md)


# ================================================================================================ run


def _device(spec: str):
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(spec)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "CUDA is not available on this machine; use --device cpu or auto")
    return d


def make_env_and_reward(cfg: LLMPolicyConfig, judge_engine_factory=None):
    from thinkcraft.envs.tasks import JudgeReward, RuleReward
    from thinkcraft.envs.textenv import make_text_env

    reward_fn = None
    if cfg.env in ("arith", "gsm8k"):
        if cfg.reward == "judge":
            engine, fmt = judge_engine_factory()
            reward_fn = JudgeReward(engine, answer_weight=cfg.answer_weight, format_weight=cfg.format_weight,
                                    format_prompt=fmt)
        else:
            reward_fn = RuleReward(answer_weight=cfg.answer_weight, format_weight=cfg.format_weight,
                                   lenient=cfg.lenient_answer)
    return make_text_env(cfg.env, reward_fn=reward_fn, difficulty=cfg.difficulty, gsm8k_path=cfg.gsm8k_path,
                         max_steps=cfg.max_turns, format_penalty=cfg.format_penalty)


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


def _prompt_corpus(cfg: LLMPolicyConfig, env) -> list[str]:
    """Texts to train a BPE on for random-weight models: instructions, problems and expected answers."""
    texts = [env.system_prompt] * 10
    if hasattr(env, "task"):
        num_problems = 200 if cfg.model == "random:tiny" else 2000  # tiny is for tests: keep BPE training short
        for s in range(num_problems):
            p = env.task.problem(s)
            texts += [p.question, f"{p.question}\n#### {p.answer}"]
    else:
        obs = env.reset(list(range(4)))
        texts += obs * 50
    return texts


def run(cfg: LLMPolicyConfig) -> dict[str, Any]:
    import torch

    from thinkcraft.llm.protocol import SamplingParams
    from thinkcraft.rl import llm_losses as L
    from thinkcraft.utils.metrics import MetricsWriter, truncate_metrics
    from thinkcraft.utils.plot import plot_curves
    from thinkcraft.utils.progress import RunProgress
    from thinkcraft.utils.timing import PhaseTimer

    run_dir = Path(cfg.run_dir)
    ckpt_path = run_dir / "checkpoint.pt"
    if not cfg.resume and ckpt_path.exists():
        raise UserError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --run-dir")
    device = _device(cfg.device)
    autocast = torch.bfloat16 if (device.type == "cuda" and cfg.bf16) else None
    base_dtype = torch.bfloat16 if (autocast is not None and cfg.finetune == "lora") else torch.float32
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    holder: dict[str, Any] = {}

    def judge_factory():
        msgs = lambda text: [{"role": "user", "content": text}]  # noqa: E731
        if cfg.judge_engine != "self":
            from thinkcraft.llm import make_engine as make_engine_from_spec

            eng = make_engine_from_spec(cfg.judge_engine)
            if hasattr(eng, "apply_chat_template"):  # in-process engines: their own chat template
                return eng, lambda text: eng.apply_chat_template(msgs(text))
            return eng, None  # HTTP engines receive the plain prompt
        holder["judge_self"] = True  # bound once the policy exists

        def fmt(text: str) -> str:
            return holder["tokenizer"].apply_chat_template(msgs(text), add_generation_prompt=True, tokenize=False)

        return _LazyEngine(holder), fmt

    env = make_env_and_reward(cfg, judge_factory)
    corpus = _prompt_corpus(cfg, env) if cfg.model.startswith("random:") else []
    model, tok = load_policy(cfg, corpus, device, base_dtype)
    holder["tokenizer"] = tok
    if cfg.thinking_budget is not None and not {"<think>", "</think>"} <= set(tok.get_vocab()):
        raise ConfigError("thinking_budget", f"{cfg.model} has no <think>/</think> tokens; drop --thinking-budget")
    engine = make_engine(model, tok, cfg)
    check_engine_for_algo(engine.capabilities, cfg.algo)
    if holder.get("judge_self"):
        holder["engine"] = _AdapterOffEngine(engine, model)
    learner = Learner(cfg, model, tok, device, autocast)
    sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                              logprobs=True, thinking_budget=cfg.thinking_budget)

    start_step, baseline, v_star_table = 0, None, None
    if cfg.resume and ckpt_path.exists():
        start_step, extra = load_checkpoint(ckpt_path, learner)
        baseline = extra.get("baseline")
        v_star_table = extra.get("v_star")
        truncate_metrics(run_dir / "metrics.jsonl", start_step)
    run_dir.mkdir(parents=True, exist_ok=True)
    from thinkcraft.utils.io import atomic_write_json

    atomic_write_json(run_dir / "config.json", asdict(cfg))

    writer = None
    if cfg.store:
        from thinkcraft.data.writer import TrajectoryWriter

        writer = TrajectoryWriter(run_dir / "trajectories", run=_run_name(run_dir), max_per_file=1024, max_seconds=30.0)

    timer = PhaseTimer()
    # A*-PO, offline phase: V*(x) from N reference samples of each prompt in the pool (π_ref = initial policy)
    if cfg.algo == "apo" and v_star_table is None:
        with timer.phase("apo_offline"):
            pool = [_seed_of(cfg, 0, i) for i in range(cfg.apo_pool_size)]
            eps = rollout(env, engine, tok, pool, cfg.apo_ref_samples, sampling, cfg.history_turns,
                          gen_context=learner.autocast)
            r = torch.tensor([e.total_reward for e in eps], dtype=torch.float64).view(len(pool), cfg.apo_ref_samples)
            v = L.apo_value(r, cfg.apo_beta1)
            v_star_table = {int(s): float(x) for s, x in zip(pool, v)}
        print(f"A*-PO: V* from {cfg.apo_ref_samples} samples x {len(pool)} prompts: mean {float(v.mean()):.3f} "
              f"(mean reward {float(r.mean()):.3f}) in {timer.seconds('apo_offline'):.1f}s")

    metrics = MetricsWriter(run_dir)
    last: dict[str, Any] = {}
    try:
        with RunProgress(cfg.steps, "llm-policy", log_every_s=cfg.log_every_s) as progress:
            for step in range(start_step, cfg.steps):
                timer.reset()
                t_step = time.perf_counter()
                # 1-2. rollout (generate + env)
                if cfg.algo == "apo":
                    rng = random.Random(cfg.seed * 1_000_003 + step)  # per step: a resumed run draws the same
                    pool_seeds = sorted(v_star_table)
                    seeds = [pool_seeds[rng.randrange(len(pool_seeds))] for _ in range(cfg.prompts_per_step)]
                else:
                    seeds = [_seed_of(cfg, step + 1, i) for i in range(cfg.prompts_per_step)]
                episodes = rollout(env, engine, tok, seeds, cfg.samples_per_prompt, sampling, cfg.history_turns, timer,
                                   gen_context=learner.autocast)
                turns = [t for e in episodes for t in e.turns]
                # 3. store
                if writer is not None:
                    with timer.phase("store"):
                        for e in episodes:
                            writer.add(episode_record(e, cfg.env, step, {"algo": cfg.algo}), learner_step=step)
                # 4. train
                with timer.phase("train"):
                    scores, groups = row_scores_and_groups(episodes, cfg.gamma, cfg.max_turns)
                    sc = torch.tensor(scores, dtype=torch.float32)
                    gid = torch.tensor(groups, dtype=torch.long)
                    v_rows = None
                    if cfg.algo == "grpo":
                        adv = L.grpo_advantages(sc, gid, scale_by_std=cfg.scale_adv_by_std)
                    elif cfg.algo == "rloo":
                        adv = L.rloo_advantages(sc, gid)
                    elif cfg.algo == "reinforce":
                        b = float(sc.mean()) if baseline is None else baseline
                        adv = L.reinforce_advantages(sc, b)
                        baseline = L.update_running_baseline(baseline, sc, cfg.baseline_momentum)
                    else:
                        v_rows = torch.tensor([v_star_table[e.seed] for e in episodes for _ in e.turns],
                                              dtype=torch.float32, device=device)
                        adv = sc - v_rows.cpu()
                    rows = build_rows(turns, adv.tolist(), scores, tok.pad_token_id, device)
                    loss_stats = learner.update(rows, v_star=v_rows)
                policy_version = step + 1
                step_s = time.perf_counter() - t_step
                # 5. log / checkpoint
                n_gen = sum(len(t.completion_ids) for t in turns)
                rewards = [e.total_reward for e in episodes]
                rec = {
                    "reward/mean": float(np.mean(rewards)),
                    "reward/std": float(np.std(rewards)),
                    "reward/turn_mean": float(np.mean([t.reward for t in turns])),
                    "format/invalid_rate": float(np.mean([t.invalid for t in turns])),
                    "completion/mean_tokens": n_gen / max(len(turns), 1),
                    "completion/truncated_rate": float(np.mean([t.finish_reason == "length" for t in turns])),
                    "episode/turns": len(turns) / len(episodes),
                    "perf/samples_per_s": len(episodes) / step_s,
                    "perf/decisions_per_s": len(turns) / step_s,
                    "perf/tokens_per_s": n_gen / step_s,
                    "perf/generate_tokens_per_s": n_gen / max(timer.seconds("generate"), 1e-9),
                    "timing/step": step_s,
                    "policy_version": policy_version,
                    "advantage/abs_mean": float(adv.abs().mean()),
                    **loss_stats,
                    **timer.metrics(),
                }
                if cfg.env in ("arith", "gsm8k"):
                    rec["reward/correct_rate"] = float(np.mean([t.info.get("correct", False) for t in turns]))
                rec.update({k: v for k, v in env.counters().items() if k.startswith("judge/")})
                last = metrics.write(policy_version, rec)
                progress.update(policy_version, reward=rec["reward/mean"], invalid=rec["format/invalid_rate"],
                                s_per_step=step_s, samples_s=rec["perf/samples_per_s"])
                if (cfg.checkpoint_every and policy_version % cfg.checkpoint_every == 0) or policy_version == cfg.steps:
                    with timer.phase("checkpoint"):
                        if writer is not None:
                            writer.flush()
                        save_checkpoint(ckpt_path, learner, policy_version,
                                        {"baseline": baseline, "v_star": v_star_table, "config": asdict(cfg)})
    finally:
        metrics.close()
        if writer is not None:
            writer.close()
    if cfg.plot:
        plot_curves(run_dir / "metrics.jsonl", run_dir / "curve.png",
                    ["reward/mean", "reward/correct_rate", "format/invalid_rate", "completion/mean_tokens",
                     "perf/samples_per_s"], title=f"llm-policy {cfg.algo} on {cfg.env}")
    return last


class _LazyEngine:
    """The judge engine when it is the policy itself: bound once the policy is loaded."""

    def __init__(self, holder: dict) -> None:
        self.holder = holder

    @property
    def capabilities(self):
        return self.holder["engine"].capabilities

    def generate(self, batch, sampling):
        return self.holder["engine"].generate(batch, sampling)

    def hidden_states(self, *a, **k):
        return self.holder["engine"].hidden_states(*a, **k)

    def close(self) -> None:
        pass


def _seed_of(cfg: LLMPolicyConfig, step: int, i: int) -> int:
    """Problem seed of prompt i at learner step `step` >= 1; step 0 is the A*-PO pool (a disjoint range)."""
    base = cfg.seed * 1_000_003 + (10**9 if step == 0 else step * cfg.prompts_per_step)
    return (base + i) % (2**31 - 1)


def _run_name(run_dir: Path) -> str:
    import re

    name = re.sub(r"[^A-Za-z0-9._-]", "-", run_dir.name) or "run"
    return name
