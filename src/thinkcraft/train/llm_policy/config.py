"""The one documented config of `thinkcraft train llm-policy` (validated before anything loads)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal


from thinkcraft.train.session import RunOptions
from thinkcraft.utils.errors import ConfigError, UserError, check

if TYPE_CHECKING:
    from thinkcraft.llm.registry import EngineSpec


Algo = Literal["grpo", "rloo", "reinforce", "apo"]
EnvName = Literal["arith", "gsm8k", "craftax", "craftax-classic"]
ALGOS_NEEDING_LOGPROBS = ("grpo", "rloo", "reinforce")
THINKING_CLOSE_TOKENS = len("\n</think>\n\n".encode())
"""Tokens the engine's forced thought close can take at most (its default text's bytes)."""

# Fields a resumed run must keep (the optimizer state holds lr and weight decay; the rest fix the model, the
# problem stream or the group structure). Others (sampling, loss coefficients, logging) may change on resume.
SHAPE_FIELDS = (
    "env", "algo", "model", "finetune", "lora_rank", "lora_alpha", "seed", "prompts_per_step", "group_size",
    "difficulty", "gsm8k_path", "max_turns", "lr", "weight_decay", "apo_pool_size", "apo_ref_samples", "apo_beta1",
)


@dataclass
class LLMPolicyConfig(RunOptions):
    """Train the LLM itself as the policy, online from env reward."""

    env: EnvName = "arith"
    """Text environment: arith (generated word problems), gsm8k (local file), craftax, craftax-classic."""
    algo: Algo = "grpo"
    """grpo (group-normalised advantages, clipped ratio), rloo (leave-one-out baseline), reinforce (running-mean
    baseline), apo (A*-PO: offline V* from reference samples, then one sample per prompt)."""
    model: str = "default"
    """'default' (bundled SmolLM2-135M-Instruct), a local HF folder, or random:<shape> (random weights with a
    byte-level BPE trained on the env's prompts; shapes: tiny, qwen2.5-0.5b) for speed measurements."""
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
    history_turns: int = -1
    """Multi-turn envs: how many past (observation, action) turns the prompt shows; -1 = all of them (prompts
    only grow, so the engine keeps each episode's KV between turns and prefills only the new tokens)."""
    max_turns: int = 8
    """Craftax: decisions per episode (the episode step cap)."""
    format_penalty: float = 0.0
    """Craftax: reward subtracted when the action cannot be parsed (a no-op is played)."""
    unroll_env_scans: Literal["auto", "on", "off"] = "auto"
    """Craftax: trace the env's short inner loops unrolled (as `train ppo`'s flag; envs/unroll.py): the same states,
    no host-driven GPU loop iterations inside a step, for more compile the first time. auto = on when JAX runs on a
    GPU."""
    action_format: Literal["free", "json"] = "free"
    """How a turn answers: free text (craftax `Action: <name>`, arith/gsm8k `#### <n>`), or json: decoding is
    constrained to one JSON object (craftax {"action": <an action name>}, arith/gsm8k {"answer": <integer>};
    xgrammar), valid by construction, and the learner's ratio uses log-probs of that constrained distribution
    (softmax over the tokens the grammar allows at each position). With --thinking-budget the thought is free
    and the answer after it constrained."""
    action_reason_chars: int = 0
    """json: a "reason" string of at most this many characters (printable ASCII) before the action/answer;
    0 = none."""
    difficulty: int = 1
    """arith: difficulty level 1..6."""
    gsm8k_path: str | None = None
    """gsm8k: local JSONL/Parquet in the GSM8K layout (question, answer ending in '#### <n>')."""
    reward: Literal["rule", "judge"] = "rule"
    """arith/gsm8k reward: rule (`#### <number>` exact match) or judge (an LLM compares gold and answer)."""
    judge_engine: str = "self"
    """Judge engine: 'self' (the policy's weights with the LoRA adapter off) or any engine spec
    (hf:<path-or-default>, vllm:<path>, sglang+http://host:port, openai+http://host:port/v1)."""
    judge_api_key_env: str | None = None
    """HTTP judge: read its API key from this environment variable (default for openai+http: $OPENAI_API_KEY)."""
    judge_api_key_file: str | None = None
    """HTTP judge: read its API key from the first line of this file (keeps it out of `ps` and shell history)."""
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
    micro_batch_tokens: int = 0
    """Tokens per forward/backward (packed: the turns' real tokens; padded: rows x the longest); gradients
    accumulate exactly over the batch. A turn longer than this gets a micro-batch of its own. 0 (default):
    sized to the device - the first update runs micro-batches of 8,192 tokens and measures the device memory a
    token costs; later updates take as many tokens as 85% of the memory left allows (a multiple of 1,024, at
    most 65,536): fewer, larger micro-batches for a learner bound by its host (a LoRA model of 24 layers
    launches ~25k operators per micro-batch, whatever its size). Off CUDA the same on the host's memory: a
    first budget of 2,048 tokens, its resident-set peak measured (Linux), then what fills half the memory the
    machine (or its cgroup) has available - a CPU has no out-of-memory error to recover from, only the kernel's
    OOM killer; where the peak cannot be measured, 2,048 stays."""
    micro_batch_size: int = 0
    """At most this many rows (a turn, or an episode's turns: --pack-episodes) per micro-batch as well; 0 = the
    token budget alone decides."""
    learner_share_prefix: bool = True
    """Packed micro-batches compute the tokens every row of the batch starts with (the system prompt, >= 32
    tokens) once, their keys and values copied in front of each row's own (varlen attention, keys and queries
    laid out apart): the same loss and gradients, fewer tokens through the model (Craftax: the 595-token system
    prompt of ~1,566-token episode rows). Off: every row computes its whole sequence."""
    learner_compile: bool | None = None
    """torch.compile the learner's packed decoder forward (and so its backward): fewer, fused kernels and less
    Python per micro-batch, for a learner bound by its host (a LoRA model of 24 layers launches ~25k operators
    per micro-batch). Llama / Qwen2 / Qwen3 / Mistral decoders compile one layer's graph that every layer runs
    (the whole Qwen2.5-0.5B forward took 282 s to compile; its update then ran 0.29 s instead of 0.40 s, H200; the
    per-layer graph of the Craftax row's LoRA update: 55-90 s, then 1.70-1.82 s instead of 2.08-2.14 s); others their
    whole forward. The first update pays the compile (inductor's on-disk cache shortens it in later runs); a
    compile failure falls back to eager once, with a warning. Packed micro-batches only. None = auto: on where
    the learner runs on CUDA, packs its micro-batches and has a plain decoder (the one-layer graph), else off;
    True forces it (any decoder), False keeps the eager forward."""
    pack: bool = True
    """Pack a micro-batch's turns into one dense sequence (varlen attention kept within each turn) instead of
    padding them to the longest; where no varlen kernel with a backward runs, the learner pads (and warns)."""
    pack_episodes: bool = True
    """Train an episode whose turns extend each other (each prompt = the previous prompt + reply + the new
    observation, token for token: the full history) as one row - its last turn, every turn's reply trained under
    its own advantage - instead of one row per turn repeating the history (the same loss and gradients, a
    fraction of the tokens); turns that do not extend (a rewriting template, a history window) keep their own."""
    logit_chunk_mib: float = 256.0
    """Token log-probs go through the LM head at trained positions only, in chunks of at most this many MiB of
    fp32 logits (forward and backward); 0 = the full (tokens x vocabulary) logits of every position at once."""
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
    kv_cache: Literal["auto", "dynamic", "static"] = "auto"
    """Decode attention width: static (the whole slot every step: one shape, one CUDA graph) or dynamic (a
    bucket of the longest running sequence); auto = static with a compiled step, else dynamic."""
    compile_decode: bool | None = None
    """torch.compile the engine's decode step (CUDA graphs; the first steps pay the compile). None = auto: on
    where the device supports it (CUDA), off elsewhere."""
    max_generate_batch: int = 1024
    """Sequences per engine decode batch."""
    kv_cache_gb: float | None = None
    """The engine's KV cache budget (GiB); None = half the GPU memory free when it is first allocated. Fewer
    slots than episodes: parked episodes' KV is evicted (their next turn is prefilled whole)."""
    seed: int = 0
    """Seeds problems, sampling and LoRA init."""
    device: str = "auto"
    """auto (the first visible GPU, cuda:0, if there is one; else cpu), cpu, cuda (this thread's current GPU),
    cuda:1, ..."""
    bf16: bool = True
    """On GPU: bf16 forward (frozen base weights stored in bf16; trainable weights stay fp32)."""
    store: bool = True
    """Write every episode to <run-dir>/trajectories (the Parquet trajectory store)."""
    checkpoint_every: int = 10
    """Checkpoint every N learner steps (and at the end); 0 = by time and at the end only. A checkpoint holds
    the adapter (or weights), optimizer, step, RNG states and the REINFORCE baseline / A*-PO V* table."""
    offpolicy: Literal["none", "decoupled", "tis"] = "none"
    """Off-policy correction of the loss for stale rollouts: none (ratio to the behaviour policy), decoupled
    (decoupled PPO: behaviour weight π_prox/π_behav outside the clip, AReaL) or tis (truncated importance
    sampling). Behaviour log-probs are the engine's."""
    offpolicy_cap: float = 2.0
    """tis: truncate behaviour weights at this C; decoupled: tokens whose weight exceeds it get weight 0 (AReaL's
    cap; 0 = no cap)."""

    # --- asynchronous training: --mode async (train/llm_policy/async_loop.py, thinkcraft.pools) ---------------
    mode: Literal["sync", "async"] = "sync"
    """sync: generate, score, train in turn; async: rollout, reward and training pools run at the same time,
    rollouts admitted while (max_staleness + version + 1) x batch > accepted + running (AReaL)."""
    max_staleness: int = 1
    """Async: η, the most learner updates between the weights that generated a token and those that train on
    it; 0 reproduces the synchronous loop."""
    rollout_workers: int = 8
    """Async: rollout workers, each playing one group (G samples of one prompt) at a time in its own env."""
    env_workers: Literal["thread", "process"] = "thread"
    """Async: envs in the workers' threads, or each in a child process (a hung or crashed env is killed and
    replaced; its group is dropped, counted and played again)."""
    env_step_timeout_s: float = 60.0
    """Async: an env step (or reset) longer than this is a hang: the env is replaced, the group dropped."""
    env_episode_timeout_s: float = 0.0
    """Async: a group's episodes running longer than this are dropped (0 = no limit)."""
    env_latency_ms: float = 0.0
    """Injected latency per env step (a slow simulator; for benchmarks and tests)."""
    max_group_attempts: int = 3
    """Async: a group that failed this many times is abandoned (counted) and a new one takes its place."""
    dynamic_sampling: bool = False
    """Async: drop groups whose rewards all agree (no signal, DAPO) and keep sampling until the batch is full."""
    weight_sync: Literal["shared", "copy"] = "shared"
    """Async, in-process engine on the learner's device: share the learner's parameters (generation and
    training take turns) or keep a copy updated after each step (they overlap; needs the memory)."""
    rollout_devices: str = ""
    """Async: in-process engines, one per device, comma-separated (e.g. cuda:0,cuda:1); engines on other
    devices than the learner's get copies of the weights (full fine-tuning on a GPU: linears and embeddings
    stored in bf16, the rounding autocast applies anyway). Empty: one engine on the learner's device."""
    rollout_servers: str = ""
    """Async: HTTP engines, comma-separated, each updated through its own endpoint: thinkcraft+http://host:port
    (thinkcraft serve), sglang+http://host:port (/update_weights_from_disk), vllm+http://host:port/v1
    (/collective_rpc reload_weights; LoRA: /v1/load_lora_adapter). With none of rollout_devices: HTTP only."""
    rollout_api_key_env: str | None = None
    """Async, --rollout-servers: send the bearer token held in this environment variable to every server."""
    rollout_api_key_file: str | None = None
    """Async, --rollout-servers: send the bearer token on the first line of this file to every server."""
    rollout_timeout_s: float = 600.0
    """Async: a generate call with no answer after this fails its group (HTTP engines: the request timeout)."""
    stall_dump_s: float = 900.0
    """Async: with no learner step for this many seconds, every thread's Python stack is written to
    <run dir>/stalls.txt (and a warning says so): where a run that seems to hang waits. 0 = off."""
    gen_batching: Literal["auto", "continuous", "whole"] = "auto"
    """Async: how the engines serve the workers' turns. continuous: each turn joins the running decode batch at
    once and comes back as soon as it ends, a group's episodes keep their KV between turns, weights are taken
    between decode steps; whole: one generate call over the turns waiting (the synchronous loop's batches at
    max_staleness 0); auto: continuous where every engine can (in-process hf engines, and Ray engine actors, whose
    engines then step on their own thread in the actor's process), else whole."""
    gen_batch_wait_ms: float = 20.0
    """Async, whole-call batching: longest a waiting generate request is held for a fuller batch while other
    episodes are still in their env step (a straggler never holds the engine)."""
    judge_batch_groups: int = 64
    """Async: groups graded together in one judge call."""

    # --- where the async pools run: --pool-backend ray (pools/ray_backend.py, train/llm_policy/ray_build.py) --
    pool_backend: Literal["local", "ray"] = "local"
    """Async: the pools' workers as threads of this process (local), or as Ray actors in one placement group:
    engines (--ray-engines), one env per rollout worker, and the judge of --reward judge (needs thinkcraft[ray])."""
    ray_address: str = ""
    """Ray: an existing cluster to join (e.g. auto, or ray://head:10001); empty starts a local Ray."""
    ray_engines: int = 1
    """Ray: engine actors, each with its own copy of the policy, batched by the driver's engine front."""
    ray_engine_gpus: float | None = None
    """Ray: GPUs per engine actor (None: 1 when this machine has CUDA, else 0)."""
    ray_engine_cpus: float = 1.0
    """Ray: CPUs per engine actor."""
    ray_env_cpus: float = 0.25
    """Ray: CPUs per rollout worker's env actor."""
    ray_judge_gpus: float | None = None
    """Ray, --reward judge with a judge engine of its own: GPUs of the judge actor (None: 1 with CUDA, else 0)."""
    ray_weight_transport: Literal["auto", "object_store", "nccl"] = "auto"
    """Ray: learner -> engines weights by an NCCL broadcast (bf16 buckets; auto with CUDA engines) or the
    object store (exact tensors; auto on CPU)."""
    ray_bucket_mb: float = 256.0
    """Ray, NCCL weight sync: size of the flat bf16 buckets broadcast."""
    ray_weight_groups: Literal["per-engine", "shared"] = "per-engine"
    """Ray, NCCL weight sync: a group per engine (each engine loads a version between its own batches) or one
    group of all engines (one broadcast per version, but the first engine's update waits for every other
    engine's running batch: 1.44 s a step with two engines, 2.21 s with three on 4 x H200, 2026-11-28)."""
    ray_start_timeout_s: float = 120.0
    """Ray: longest wait for the placement group; past it the run stops naming the resources it waited for."""

    def validate(self) -> None:
        check(self.steps >= 1, "steps", "must be >= 1")
        check(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
        check(self.group_size >= 1, "group_size", "must be >= 1")
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(self.temperature > 0, "temperature", "must be > 0 (sampling; the policy gradient needs samples)")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.history_turns >= -1, "history_turns", "must be >= 0 (a window of past turns) or -1 (all of them)")
        check(self.max_turns >= 1, "max_turns", "must be >= 1")
        check(self.unroll_env_scans in ("auto", "on", "off"), "unroll_env_scans", "auto, on or off")
        check(1 <= self.difficulty <= 6, "difficulty", "must be in 1..6")
        check(self.stall_dump_s >= 0, "stall_dump_s", "must be >= 0 (0 = off)")
        check(self.micro_batch_tokens >= 0, "micro_batch_tokens", "must be >= 1 (or 0: sized to the device)")
        check(self.micro_batch_size >= 0, "micro_batch_size", "must be >= 0 (0 = no row limit)")
        check(self.logit_chunk_mib >= 0, "logit_chunk_mib", "must be >= 0 (0 = full logits)")
        check(self.kv_cache_gb is None or self.kv_cache_gb > 0, "kv_cache_gb", "must be > 0 (or unset)")
        check(self.lr > 0, "lr", "must be > 0")
        check(self.lora_rank >= 1, "lora_rank", "must be >= 1")
        check(0 <= self.gamma <= 1, "gamma", "must be in [0, 1]")
        check(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        check(self.pack or self.learner_compile is not True, "learner_compile",
              "compiles the packed forward: it needs --pack (drop --no-pack or --learner-compile True)")
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
        if self.judge_api_key_env or self.judge_api_key_file:
            check(self.judge_engine != "self" and _parsed("judge_engine", self.judge_engine).is_http, "judge_api_key_env",
                  "an API key is for an HTTP judge (--judge-engine openai+http://... or sglang+http://...)")
            self.judge_engine_options()  # an unset variable or unreadable file fails here, before any loading
        if self.thinking_budget is not None:
            check(0 < self.thinking_budget < self.max_new_tokens, "thinking_budget", "must be in (0, max_new_tokens)")
        self._validate_action_format()
        spec = _parsed("model", self.model, bare="hf", allowed=("hf", "random"))
        if spec.scheme == "random":
            check(spec.target in MODEL_SHAPES, "model", f"unknown shape {spec.target!r}; known: {', '.join(MODEL_SHAPES)}")
        if self.judge_engine != "self":
            _parsed("judge_engine", self.judge_engine, allowed=("hf", "vllm", "sglang", "openai", "auto"))
        check(self.offpolicy_cap >= 0, "offpolicy_cap", "must be >= 0")
        check(self.offpolicy != "tis" or self.offpolicy_cap > 0, "offpolicy_cap", "tis truncates at C > 0")
        self._check_async()

    def _check_async(self) -> None:
        from thinkcraft.train.llm_policy.async_loop import check_async_config

        check_async_config(self)
        from thinkcraft.train.llm_policy.ray_build import check_ray_config

        check_ray_config(self)

    def _validate_action_format(self) -> None:
        """json answers: a grammar xgrammar builds, and a token budget that always holds the longest answer (after
        the longest thought: the budget, the forced close, the answer), so that no answer is ever cut."""
        check(self.action_reason_chars >= 0, "action_reason_chars", "must be >= 0")
        if self.action_format != "json":
            check(self.action_reason_chars == 0, "action_reason_chars", "is for --action-format json")
            return
        from thinkcraft.envs.textenvs import jsonformat
        from thinkcraft.llm.constrained import check_schema

        names = None
        if self.is_multi_turn:
            from thinkcraft.envs.text.names import ACTION_NAMES

            names = ACTION_NAMES[self.env]
        schema = (jsonformat.action_schema(names, self.action_reason_chars) if names is not None
                  else jsonformat.answer_schema(self.action_reason_chars))
        try:
            check_schema(schema)
        except UserError as e:
            raise ConfigError("action_format", str(e)) from None
        answer = jsonformat.max_answer_tokens(names, self.action_reason_chars)
        thought = 0 if self.thinking_budget is None else self.thinking_budget + THINKING_CLOSE_TOKENS
        check(self.max_new_tokens >= thought + answer, "max_new_tokens",
              f"must be >= {thought + answer} with --action-format json"
              + (f" (thinking budget {self.thinking_budget} + its close {THINKING_CLOSE_TOKENS}" if thought else " (")
              + f"{' + ' if thought else ''}the longest answer {answer} tokens), so that no answer is cut")

    @property
    def model_spec(self) -> EngineSpec:
        """`model` parsed (`llm.registry.EngineSpec`): scheme "hf" (target: default / a folder) or "random"
        (target: a MODEL_SHAPES name)."""
        return _parsed("model", self.model, bare="hf", allowed=("hf", "random"))

    def judge_engine_options(self) -> dict[str, Any]:
        """Options for `make_engine(judge_engine, ...)`: the HTTP judge's API key, resolved from its source."""
        from thinkcraft.utils.apikey import resolve_config_key

        key = resolve_config_key(None, self.judge_api_key_env, self.judge_api_key_file,
                                 names=("judge_api_key", "judge_api_key_env", "judge_api_key_file"))
        return {"api_key": key} if key else {}

    def rollout_api_key(self) -> str | None:
        """The rollout servers' API key, resolved from its source (None: no key)."""
        from thinkcraft.utils.apikey import resolve_config_key

        return resolve_config_key(None, self.rollout_api_key_env, self.rollout_api_key_file,
                                  names=("rollout_api_key", "rollout_api_key_env", "rollout_api_key_file"))

    def run_label(self) -> str:
        return f"{self.env}-{self.algo}-s{self.seed}"

    @property
    def is_multi_turn(self) -> bool:
        return self.env in ("craftax", "craftax-classic")

    @property
    def samples_per_prompt(self) -> int:
        return 1 if self.algo == "apo" else self.group_size


# ===================================================================================== model + tokenizer

def _parsed(field: str, spec: str, **how: Any) -> Any:
    """`llm.registry.parse_spec`, its error reported against the config field."""
    from thinkcraft.llm.registry import parse_spec

    try:
        return parse_spec(spec, **how)
    except UserError as e:
        raise ConfigError(field, str(e)) from None


# Random-weight shapes for speed measurements (`--model random:<shape>`).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, tie_word_embeddings=True),
    # Qwen2.5-0.5B body (ANCHORS.md, TRL reference): 358M parameters with a 2,048-token vocabulary
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, tie_word_embeddings=True, rope_theta=1_000_000.0),
    # Qwen3-4B body (llm.testing.qwen3_4b_config): q/k norms, 128-dim heads; the vocabulary is the BPE's
    "qwen3-4b": dict(arch="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, tie_word_embeddings=True,
                     rope_theta=1_000_000.0, rms_norm_eps=1e-6),
}

REAL_VOCAB: dict[str, int] = {"qwen2.5-0.5b": 151_936, "qwen3-4b": 151_936}
"""The real models' vocabulary sizes (their LM heads' rows), for learner-only measurements that feed synthetic
token ids to `random_model(shape, vocab_size=...)` (bench/learner_memory.py): the head's cost and the logits'
memory are the real ones without training a 151,936-token BPE. MODEL_SHAPES' BPE vocabulary is 2,048 ids."""
