"""Offline labelling of game states (or any prompts) with LLMs, resumable, and weak-to-strong distillation.

    thinkcraft collect --out runs/states --num-envs 8 --num-steps 64          # states -> Parquet
    thinkcraft label --input runs/states --out-dir runs/lab --fields action:string,subgoal:string \\
        --endpoints providers.toml --pack-size 8                               # or --engine hf:default
    thinkcraft distill --labels runs/lab --out-dir runs/distill               # LoRA student labels the rest

Modules: `template` (prompts, output schemas, keys, packing — pure), `prompts` (chat template or raw, the
shared prefix as token ids), `store` (journal + atomic Parquet shards), `providers` (OpenAI-compatible
endpoints: limits, weights, failures, structured outputs), `report` (cumulative report.json, failures.jsonl),
`threads` (CPU threads under load), `pipeline` (the command), `collect`, `distill`. Constrained decoding
itself is `thinkcraft.llm.constrained`.

An endpoints file (TOML):

    model = "gpt-4.1-mini"            # optional: the model name used in item keys
    [[endpoints]]
    name = "openai"
    base_url = "https://api.openai.com/v1"
    model = "gpt-4.1-mini"
    api_key_env = "OPENAI_API_KEY"     # your own key, from the environment (or api_key_file = "~/.openai-key")
    rpm = 500                          # stay under your account's limits
    tpm = 200000
    max_concurrency = 8
    weight = 3                         # share of the work against the other endpoints
    extra_body = {prompt_cache_key = "craftax-labels"}
"""
