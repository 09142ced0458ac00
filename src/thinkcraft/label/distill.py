"""`thinkcraft distill`: weak-to-strong distillation of a teacher's labels into a small student.

Phases: (1) read the teacher's labelled run (`thinkcraft label` output: its config names the input and
the template) and rebuild every item's prompt and key; (2) split the labelled (golden) items into train
and held-out by key hash (stable across runs); (3) fine-tune a LoRA adapter (peft) on the student (the
bundled model by default) with the loss on the answer tokens only, tokenized exactly as the engine
tokenizes prompts (prefix and item apart); (4) generate the held-out answers with the student and report
agreement with the teacher; (5) label every item the teacher did not with the student, through the same
resumable pipeline (`<out_dir>/student_labels`).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from thinkcraft.label.pipeline import LabelConfig, label, prepare_items, read_input, read_labels
from thinkcraft.label.template import OutputSpec, Template, parse_output
from thinkcraft.utils.errors import ConfigError, UserError, check
from thinkcraft.utils.io import atomic_write_json
from thinkcraft.utils.signals import sigterm_as_interrupt


@dataclass
class DistillConfig:
    labels: str
    """Output folder of a `thinkcraft label` run: the teacher's (golden) labels."""
    out_dir: str = "runs/distill"
    """Adapter, metrics, report and the student's labels (`student_labels/`) go here."""
    input: str | None = None
    """Items to label with the student (default: the teacher run's input; items the teacher labelled are skipped)."""
    student: str = "default"
    """Student model: `default` (bundled SmolLM2-135M-Instruct) or a local HF folder."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: str = "q_proj,k_proj,v_proj,o_proj"
    """Comma-separated module names that get LoRA adapters."""
    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 8
    """Examples per step."""
    lr: float = 2e-4
    max_len: int = 1024
    """Truncate prompt+answer to this many tokens (the prompt is cut from the left, the answer kept)."""
    heldout_frac: float = 0.2
    """Fraction of the teacher's labels kept out of training to measure agreement."""
    max_new_tokens: int = 128
    gen_batch_size: int = 32
    """Items per student generation call."""
    device: str | None = None
    """cuda / cpu (default: cuda when available)."""
    seed: int = 0
    log_every: int = 10

    def __post_init__(self) -> None:
        check(Path(self.labels).is_dir(), "labels", f"{self.labels} is not a folder")
        check((Path(self.labels) / "label_config.json").exists(), "labels",
              f"{self.labels} has no label_config.json: is it the output folder of `thinkcraft label`?")
        check(self.input is None or Path(self.input).exists(), "input", f"{self.input} does not exist")
        check(self.lora_r >= 1, "lora_r", "must be >= 1")
        check(self.steps >= 0, "steps", "must be >= 0")
        check(self.batch_size >= 1, "batch_size", "must be >= 1")
        check(self.lr > 0, "lr", "must be > 0")
        check(0.0 <= self.heldout_frac < 1.0, "heldout_frac", "must be in [0, 1)")
        check(self.max_len >= 16, "max_len", "must be >= 16")
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")


# --- pure helpers ---------------------------------------------------------------------------------


def in_heldout(key: str, frac: float) -> bool:
    """Stable split by key hash: the same item is held out in every run."""
    return int(hashlib.sha256(("heldout:" + key).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < frac


def target_text(output: str, parsed_json: str | None, spec: OutputSpec) -> str:
    """What the student learns to write: canonical compact JSON for JSON specs, else the stripped text."""
    if spec.is_json and parsed_json is not None:
        return json.dumps(json.loads(parsed_json), separators=(", ", ": "))
    return output.strip()


def _tokens(s: str) -> list[str]:
    return s.lower().split()


def token_f1(a: str, b: str) -> float:
    ta, tb = _tokens(a), _tokens(b)
    if not ta and not tb:
        return 1.0
    common = sum(min(ta.count(w), tb.count(w)) for w in set(ta))
    if common == 0:
        return 0.0
    p, r = common / len(ta), common / len(tb)
    return 2 * p * r / (p + r)


def agreement(student: Sequence[str], teacher: Sequence[Any], spec: OutputSpec) -> dict[str, float]:
    """Student answers (raw text) vs the teacher's parsed answers.

    JSON: valid rate, exact match (all fields), and per-field match rate; free text: normalised exact match
    and mean token F1."""
    n = len(student)
    if n == 0:
        return {"n": 0}
    if not spec.is_json:
        norm = [" ".join(_tokens(s)) for s in student]
        exact = sum(a == " ".join(_tokens(t)) for a, t in zip(norm, teacher)) / n
        f1 = sum(token_f1(s, t) for s, t in zip(student, teacher)) / n
        return {"n": n, "exact_match": exact, "token_f1": f1}
    fields = list((spec.schema or {}).get("properties", {}))
    valid = exact = 0
    per_field = {f: 0 for f in fields}
    for s, t in zip(student, teacher):
        p = parse_output(s, spec)
        if p.error is not None:
            continue
        valid += 1
        exact += all(p.value.get(f) == t.get(f) for f in fields)
        for f in fields:
            per_field[f] += p.value.get(f) == t.get(f)
    out = {"n": n, "valid": valid / n, "exact_match": exact / n}
    out.update({f"field/{f}": v / n for f, v in per_field.items()})
    return out


# --- training -------------------------------------------------------------------------------------


def _examples(engine: Any, prefix: str, items: Sequence[str], targets: Sequence[str], max_len: int,
              eos_id: int) -> list[tuple[list[int], int]]:
    """(token ids, number of prompt tokens) per example, tokenized as the engine tokenizes prompts."""
    from thinkcraft.llm.protocol import Batch

    pre, its = engine.tokenize_batch(Batch(items=list(items), prefix=prefix or None))
    out = []
    for it, tgt in zip(its, targets):
        ans = list(engine.tokenizer(tgt, add_special_tokens=False)["input_ids"]) + [eos_id]
        prompt = pre + it
        keep = max(1, max_len - len(ans))
        prompt = prompt[-keep:]  # the answer is what we train on: cut the prompt's start if too long
        out.append((prompt + ans, len(prompt)))
    return out


def train_lora(model: Any, examples: Sequence[tuple[list[int], int]], steps: int, batch_size: int, lr: float,
               pad_id: int, seed: int, log: Any = None, log_every: int = 10) -> list[float]:
    """Adam on the LoRA parameters, loss = mean NLL of the answer tokens; returns the loss per step."""
    import torch

    rng = random.Random(seed)
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    order: list[int] = []
    for step in range(steps):
        batch = []
        for _ in range(min(batch_size, len(examples))):
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch.append(examples[order.pop()])
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (seq, n_prompt) in enumerate(batch):  # right padding; loss on answer tokens only
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, n_prompt: len(seq)] = torch.tensor(seq[n_prompt:])
            mask[i, : len(seq)] = 1
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(out.loss.detach()))
        if log is not None and (step % log_every == 0 or step == steps - 1):
            log(step + 1, {"losses/nll": losses[-1]})
    model.eval()
    return losses


class _StudentEngine:
    """The student as an engine for the label pipeline (`generate` only), with its name for item keys."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def generate(self, batch: Any, sampling: Any) -> Any:
        return self._engine.generate(batch, sampling)

    def close(self) -> None:
        pass


# --- command --------------------------------------------------------------------------------------


def _teacher(cfg: DistillConfig) -> tuple[dict[str, Any], Template]:
    saved = json.loads((Path(cfg.labels) / "label_config.json").read_text(encoding="utf-8"))
    t = saved["template"]
    return saved, Template(prefix=t["prefix"], item=t["item"], output=OutputSpec(t["output"]["schema"]))


@sigterm_as_interrupt("run the same command again: the student's training starts over (it takes minutes and is "
                      "not checkpointed); its labelling of the rest continues from its journal")
def run(cfg: DistillConfig) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.models import resolve_model
    from thinkcraft.llm.protocol import Batch, SamplingParams
    from thinkcraft.utils.metrics import MetricsWriter
    from thinkcraft.utils.progress import console
    from thinkcraft.utils.timing import PhaseTimer

    timer = PhaseTimer()
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved, template = _teacher(cfg)
    teacher_model = saved["model"]

    # (1) the teacher's items, keys and labels
    with timer.phase("data"):
        t_input = read_input(saved["input"])
        t_items, _ = prepare_items(t_input, template, teacher_model)
        labels = read_labels(cfg.labels).to_pylist()
        by_key = {r["key"]: r for r in labels}
        golden = [it for it in t_items if it.key in by_key]
        if not golden:
            raise UserError(f"{cfg.labels} holds no labels for its input: run `thinkcraft label` first")
        # (2) stable split
        heldout = [it for it in golden if in_heldout(it.key, cfg.heldout_frac)]
        train = [it for it in golden if not in_heldout(it.key, cfg.heldout_frac)]
        if not train:
            raise ConfigError("heldout_frac", f"leaves no training item out of {len(golden)}; lower it")

    # (3) student + LoRA
    with timer.phase("load"):
        path = resolve_model(cfg.student)
        device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        torch.manual_seed(cfg.seed)
        tok = AutoTokenizer.from_pretrained(str(path))
        base = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device)
        modules = [m.strip() for m in cfg.target_modules.split(",") if m.strip()]
        lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=modules, task_type="CAUSAL_LM")
        try:
            model = get_peft_model(base, lcfg)
        except ValueError as e:
            raise ConfigError("target_modules", f"{e}") from None
        engine = HFEngine.from_model(model, tok)
        eos_id = tok.eos_token_id if tok.eos_token_id is not None else engine.pad_id
    prefix = template.instructions
    targets = [target_text(by_key[it.key]["output"], by_key[it.key]["parsed_json"], template.output) for it in train]
    examples = _examples(engine, prefix, [it.text for it in train], targets, cfg.max_len, eos_id)
    metrics = MetricsWriter(out_dir)
    console.print(f"distill: {len(golden)} teacher labels -> {len(train)} train / {len(heldout)} held out; "
                  f"student {path.name} + LoRA r={cfg.lora_r}, {cfg.steps} steps")
    with timer.phase("train"):
        losses = train_lora(model, examples, cfg.steps, cfg.batch_size, cfg.lr, engine.pad_id, cfg.seed,
                            log=metrics.write, log_every=cfg.log_every)
    engine.invalidate_prefix_cache()
    model.save_pretrained(str(out_dir / "adapter"))

    # (4) agreement on held-out
    sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0, logprobs=False, seed=cfg.seed)
    answers: list[str] = []
    with timer.phase("heldout"):
        for a in range(0, len(heldout), cfg.gen_batch_size):
            chunk = heldout[a:a + cfg.gen_batch_size]
            answers += [c.text for c in engine.generate(Batch(items=[it.text for it in chunk], prefix=prefix), sampling)]
    teacher_vals = [_teacher_value(by_key[it.key], template.output) for it in heldout]
    agree = agreement(answers, teacher_vals, template.output)
    metrics.write(cfg.steps, {f"agreement/{k}": v for k, v in agree.items()})
    atomic_write_json(out_dir / "heldout.json", [
        {"row": it.row, "teacher": by_key[it.key]["output"], "student": s} for it, s in zip(heldout, answers)])

    # (5) the rest, labelled by the student through the resumable pipeline
    digest = hashlib.sha256(json.dumps({"student": str(path), "teacher_run": str(Path(cfg.labels).resolve()),
                                        "cfg": asdict(cfg)}, sort_keys=True, default=str).encode()).hexdigest()[:12]
    student_name = f"student:{path.name}:{digest}"
    rest_input = cfg.input or saved["input"]
    rest_path = _write_rest(rest_input, template, teacher_model, set(by_key), out_dir)
    rest_report: dict[str, Any] = {"to_label": 0}
    if rest_path is not None:
        (out_dir / "template.json").write_text(json.dumps(
            {"prefix": template.prefix, "item": template.item, "schema": template.output.schema}))
        lcfg2 = LabelConfig(input=str(rest_path), out_dir=str(out_dir / "student_labels"),
                            template=str(out_dir / "template.json"), batch_size=cfg.gen_batch_size,
                            max_new_tokens=cfg.max_new_tokens, temperature=0.0, seed=cfg.seed)
        with timer.phase("label_rest"):
            rest_report = label(lcfg2, engine=_StudentEngine(engine), model_name=student_name)
    metrics.close()
    report = {
        "labels": cfg.labels, "teacher_model": teacher_model, "student": str(path), "student_name": student_name,
        "golden": len(golden), "train": len(train), "heldout": len(heldout),
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "agreement": agree, "rest_to_label": rest_report.get("to_label", 0),
        "rest_labelled": rest_report.get("labelled", 0) + rest_report.get("already_done", 0),
        "rest_invalid": rest_report.get("invalid", 0), **timer.metrics(), "config": asdict(cfg),
    }
    atomic_write_json(out_dir / "distill_report.json", report)
    _print(report)
    return report


def _teacher_value(row: dict[str, Any], spec: OutputSpec) -> Any:
    return json.loads(row["parsed_json"]) if spec.is_json and row["parsed_json"] else row["output"].strip()


def _write_rest(input_path: str, template: Template, teacher_model: str, labelled: set[str], out_dir: Path
                ) -> Path | None:
    """Parquet of the input rows whose items the teacher did not label (`source_row` = their input index)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = read_input(input_path)
    items, _ = prepare_items(table, template, teacher_model)
    rest_rows = sorted({it.row for it in items if it.key not in labelled})
    if not rest_rows:
        return None
    cols = list(dict.fromkeys(template.columns))
    rest = table.select(cols).take(pa.array(rest_rows)).append_column("source_row", pa.array(rest_rows, pa.int64()))
    path = out_dir / "rest.parquet"
    from thinkcraft.utils.io import atomic_path

    with atomic_path(path) as tmp:
        pq.write_table(rest, tmp)
    return path


def _print(report: dict[str, Any]) -> None:
    from rich.table import Table

    from thinkcraft.utils.progress import console

    t = Table(title="distill report", show_header=False)
    for k in ("student", "golden", "train", "heldout", "loss_first", "loss_last", "rest_to_label",
              "rest_labelled", "rest_invalid"):
        v = report[k]
        t.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    for k, v in report["agreement"].items():
        t.add_row(f"agreement {k}", f"{v:.3f}" if isinstance(v, float) else str(v))
    console.print(t)
