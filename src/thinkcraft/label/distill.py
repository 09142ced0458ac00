"""`thinkcraft distill`: weak-to-strong distillation of a teacher's labels into a (different) student.

Phases: (1) read the teacher's labelled run (`thinkcraft label` output: its config names the input and
the template) and rebuild every item's prompt and key; (2) split the labelled (golden) items into train
and held-out by key hash (stable across runs); (3) answer the held-out items with the student *before*
training, and take the majority label of the training split: the two baselines; (4) fine-tune a LoRA
adapter (peft) on the student with the loss on the answer tokens only, tokenized exactly as the label
pipeline prompts it (chat template, shared prefix; prompts.py), with a progress bar; (5) answer the
held-out items again and report agreement with the teacher beside both baselines, on the same items;
(6) label every item the teacher did not with the student, through the same resumable pipeline
(`<out_dir>/student_labels`).

The student must be another model than the teacher (distilling a model into itself measures nothing:
issue 22 got agreement 1.000 with --steps 0): the default student is the bundled SmolLM2-135M-Instruct,
refused when the teacher is that model too, unless --allow-same-model.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from thinkcraft.label.agreement import (  # noqa: F401 - also this module's public names
    agreement, in_heldout, majority_answer, target_text, token_f1,
)
from thinkcraft.label.pipeline import (
    LabelConfig, WorkItem, generate_completions, label, prepare_items, read_input, read_labels,
)
from thinkcraft.label.prompts import PromptFormat
from thinkcraft.label.template import OutputSpec, Template
from thinkcraft.utils.errors import ConfigError, UserError, check
from thinkcraft.utils.io import atomic_write_json
from thinkcraft.utils.signals import sigterm_as_interrupt


@dataclass
class DistillConfig:
    labels: str
    """Output folder of a `thinkcraft label` run: the teacher's (golden) labels."""
    out_dir: str = "runs/distill"
    """Adapter, metrics, distill_report.json, heldout.json, and the student's labels of the rest in
    `<out-dir>/student_labels/` (a resumable `thinkcraft label` folder: shards, report.json, failures.jsonl)."""
    input: str | None = None
    """Items the student labels after training ("label the rest"): default the teacher run's own input (the
    `input` in `<labels>/label_config.json`); items the teacher labelled are skipped."""
    student: str | None = None
    """Student model: a local HF folder, or `default` (bundled SmolLM2-135M-Instruct). Default: the bundled
    model, which is refused when the teacher is the bundled model too (pass another model then)."""
    allow_same_model: bool = False
    """Allow the student to be the teacher's model (self-distillation; agreement then starts near 1)."""
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
    prompt_format: PromptFormat = "auto"
    """How the student is prompted (as `thinkcraft label --prompt-format`): chat template when it has one."""
    constrain: bool = True
    """Student answers (held-out and the rest) decoded under the teacher run's schema (see `thinkcraft label`)."""
    threads: int = 0
    """CPU threads for torch; 0 = auto (see `thinkcraft label --threads`)."""
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
        check(self.threads >= 0, "threads", "must be >= 0 (0 = auto)")
        teacher = _teacher_model(self.labels)
        if not self.allow_same_model and same_model(teacher, self.student or "default"):
            hint = ("the default student is the bundled model; pass --student <a local HF folder of another model>"
                    if self.student is None else "pass a different --student")
            raise ConfigError("student", f"the teacher's labels come from {teacher!r}, the same model as the student: "
                              f"distilling a model into itself measures nothing; {hint}, or --allow-same-model")


def _teacher_model(labels: str) -> str:
    return str(json.loads((Path(labels) / "label_config.json").read_text(encoding="utf-8")).get("model", ""))


def same_model(teacher: str, student: str) -> bool:
    """Do two model names/paths name one model? Aliases of the bundled model, folder paths (resolved) and
    folder names (a server's model id is often the folder's name) all count."""
    from thinkcraft.llm.models import ALIASES, DEFAULT_NAME

    def names(m: str) -> set[str]:
        m = m.strip()
        if m.lower() in ALIASES:
            return {DEFAULT_NAME}
        p = Path(m).expanduser()
        out = {p.name.lower()} if p.name else set()
        if p.exists():
            out.add(str(p.resolve()).lower())
        return out | ({DEFAULT_NAME} if p.name.lower() == DEFAULT_NAME else set())

    return bool(names(teacher) & names(student))


# --- training -------------------------------------------------------------------------------------


def _examples(prompt_ids: Sequence[list[int]], answer_ids: Sequence[list[int]], max_len: int
              ) -> list[tuple[list[int], int]]:
    """(token ids, number of prompt tokens) per example: the prompt as the label pipeline sends it, then
    the answer (ending with EOS); the prompt's start is cut when the whole is longer than max_len."""
    out = []
    for prompt, ans in zip(prompt_ids, answer_ids):
        keep = max(1, max_len - len(ans))
        prompt = list(prompt)[-keep:]  # the answer is what we train on
        out.append((prompt + list(ans), len(prompt)))
    return out


def train_lora(model: Any, examples: Sequence[tuple[list[int], int]], steps: int, batch_size: int, lr: float,
               pad_id: int, seed: int, log: Any = None, log_every: int = 10, progress: Any = None) -> list[float]:
    """Adam on the LoRA parameters, loss = mean NLL of the answer tokens; returns the loss per step.
    `progress(step, loss)` is called after every step (the progress bar)."""
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
        if progress is not None:
            progress(step + 1, losses[-1])
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


@dataclass
class _Student:
    """The loaded student: LoRA-wrapped model, its engine, how it is prompted and sampled."""

    path: Path
    model: Any
    tokenizer: Any
    engine: Any
    prompts: Any
    sampling: Any
    eos_id: int


def _load_student(cfg: DistillConfig, template: Template) -> _Student:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from thinkcraft.label.prompts import make_prompts
    from thinkcraft.llm.constrained import StructuredOutput
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.models import resolve_model
    from thinkcraft.llm.protocol import SamplingParams

    path = resolve_model(cfg.student or "default")
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
    structured = StructuredOutput.from_schema(template.output.schema) if cfg.constrain and template.output.is_json else None
    sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0, logprobs=False, seed=cfg.seed,
                              structured=structured)
    eos_id = tok.eos_token_id if tok.eos_token_id is not None else engine.pad_id
    return _Student(path, model, tok, engine, make_prompts(cfg.prompt_format, tok, template.instructions), sampling,
                    eos_id)


def _answers(st: _Student, items: Sequence[WorkItem], batch_size: int) -> list[str]:
    out: list[str] = []
    for a in range(0, len(items), batch_size):
        texts = [it.text for it in items[a:a + batch_size]]
        out += [c.text for c in generate_completions(st.engine, st.prompts, texts, st.sampling)]
    return out


def run(cfg: DistillConfig) -> dict[str, Any]:
    from thinkcraft.label.threads import ThreadPolicy
    from thinkcraft.utils.metrics import MetricsWriter
    from thinkcraft.utils.progress import RunProgress, console
    from thinkcraft.utils.timing import PhaseTimer

    timer = PhaseTimer()
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved, template = _teacher(cfg)
    teacher_model = saved["model"]
    ThreadPolicy(cfg.threads).apply()

    # (1) the teacher's items, keys and labels; (2) stable split
    with timer.phase("data"):
        t_input = read_input(saved["input"])
        t_items, _ = prepare_items(t_input, template, teacher_model, saved.get("key_format", "raw"))
        by_key = {r["key"]: r for r in read_labels(cfg.labels).to_pylist()}
        golden = [it for it in t_items if it.key in by_key]
        if not golden:
            raise UserError(f"{cfg.labels} holds no labels for its input: run `thinkcraft label` first")
        heldout = [it for it in golden if in_heldout(it.key, cfg.heldout_frac)]
        train = [it for it in golden if not in_heldout(it.key, cfg.heldout_frac)]
        if not train:
            raise ConfigError("heldout_frac", f"leaves no training item out of {len(golden)}; lower it")
    with timer.phase("load"):
        st = _load_student(cfg, template)
    if not cfg.allow_same_model and same_model(teacher_model, str(st.path)):
        raise ConfigError("student", f"{st.path} is the teacher's model ({teacher_model}); pass another --student "
                          "or --allow-same-model")
    teacher_vals = [_teacher_value(by_key[it.key], template.output) for it in heldout]
    metrics = MetricsWriter(out_dir)
    console.print(f"distill: {len(golden)} teacher labels ({teacher_model}) -> {len(train)} train / {len(heldout)} "
                  f"held out; student {st.path.name} + LoRA r={cfg.lora_r}, {cfg.steps} steps")

    # (3) baselines on the held-out items: the untrained student, and the majority label of the train split
    with timer.phase("baseline"):
        before = _answers(st, heldout, cfg.gen_batch_size)
    majority = majority_answer([_teacher_value(by_key[it.key], template.output) for it in train], template.output)
    baselines = {"majority": agreement([majority] * len(heldout), teacher_vals, template.output),
                 "student_before": agreement(before, teacher_vals, template.output)}

    # (4) train
    targets = [target_text(by_key[it.key]["output"], by_key[it.key]["parsed_json"], template.output) for it in train]
    answer_ids = [list(st.tokenizer(t, add_special_tokens=False)["input_ids"]) + [st.eos_id] for t in targets]
    examples = _examples(st.prompts.prompt_ids(st.engine, [it.text for it in train]), answer_ids, cfg.max_len)
    with timer.phase("train"), RunProgress(cfg.steps, "distill", log_every_s=10.0) as prog:
        losses = train_lora(st.model, examples, cfg.steps, cfg.batch_size, cfg.lr, st.engine.pad_id, cfg.seed,
                            log=metrics.write, log_every=cfg.log_every,
                            progress=lambda step, loss: prog.update(step, loss=loss))
    st.engine.invalidate_prefix_cache()
    st.model.save_pretrained(str(out_dir / "adapter"))

    # (5) agreement after training, on the same held-out items
    with timer.phase("heldout"):
        answers = _answers(st, heldout, cfg.gen_batch_size)
    agree = agreement(answers, teacher_vals, template.output)
    metrics.write(cfg.steps, {f"agreement/{k}": v for k, v in agree.items()}
                  | {f"baseline/{b}/{k}": v for b, a in baselines.items() for k, v in a.items()})
    atomic_write_json(out_dir / "heldout.json", [
        {"row": it.row, "teacher": by_key[it.key]["output"], "student_before": b, "student": s}
        for it, b, s in zip(heldout, before, answers)])

    # (6) the rest, labelled by the student through the resumable pipeline
    rest_report = _label_rest(cfg, st, saved, template, teacher_model, set(by_key), out_dir, timer)
    metrics.close()
    report = {
        "labels": cfg.labels, "teacher_model": teacher_model, "student": str(st.path),
        "student_name": rest_report.pop("_student_name"), "golden": len(golden), "train": len(train),
        "heldout": len(heldout), "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None, "agreement": agree, "baselines": baselines,
        "majority_answer": majority, "rest_input": rest_report.pop("_rest_input"),
        "rest_out_dir": str(out_dir / "student_labels"), "rest_to_label": rest_report.get("to_label", 0),
        "rest_labelled": rest_report.get("labelled", 0) + rest_report.get("already_done", 0),
        "rest_invalid": rest_report.get("invalid", 0), **timer.metrics(), "config": asdict(cfg),
    }
    atomic_write_json(out_dir / "distill_report.json", report)
    _print(report)
    return report


def _label_rest(cfg: DistillConfig, st: _Student, saved: dict[str, Any], template: Template, teacher_model: str,
                labelled: set[str], out_dir: Path, timer: Any) -> dict[str, Any]:
    """Items of `cfg.input` (default: the teacher's input) the teacher did not label -> `student_labels/`."""
    digest = hashlib.sha256(json.dumps({"student": str(st.path), "teacher_run": str(Path(cfg.labels).resolve()),
                                        "cfg": asdict(cfg)}, sort_keys=True, default=str).encode()).hexdigest()[:12]
    student_name = f"student:{st.path.name}:{digest}"
    rest_input = cfg.input or saved["input"]
    rest_path = _write_rest(rest_input, template, teacher_model, labelled, out_dir, saved.get("key_format", "raw"))
    rest_report: dict[str, Any] = {"to_label": 0}
    if rest_path is not None:
        (out_dir / "template.json").write_text(json.dumps(
            {"prefix": template.prefix, "item": template.item, "schema": template.output.schema}))
        lcfg = LabelConfig(input=str(rest_path), out_dir=str(out_dir / "student_labels"),
                           template=str(out_dir / "template.json"), batch_size=cfg.gen_batch_size,
                           max_new_tokens=cfg.max_new_tokens, temperature=0.0, seed=cfg.seed,
                           prompt_format=cfg.prompt_format, constrain=cfg.constrain, threads=cfg.threads)
        with timer.phase("label_rest"):
            rest_report = label(lcfg, engine=_StudentEngine(st.engine), model_name=student_name, tokenizer=st.tokenizer)
    return {**rest_report, "_student_name": student_name, "_rest_input": str(rest_input)}


def _teacher_value(row: dict[str, Any], spec: OutputSpec) -> Any:
    return json.loads(row["parsed_json"]) if spec.is_json and row["parsed_json"] else row["output"].strip()


def _write_rest(input_path: str, template: Template, teacher_model: str, labelled: set[str], out_dir: Path,
                prompt_format: str = "raw") -> Path | None:
    """Parquet of the input rows whose items the teacher did not label (`source_row` = their input index)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = read_input(input_path)
    items, _ = prepare_items(table, template, teacher_model, prompt_format)
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
    for k in ("student", "teacher_model", "golden", "train", "heldout", "loss_first", "loss_last", "rest_to_label",
              "rest_labelled", "rest_invalid", "rest_out_dir"):
        v = report[k]
        t.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    console.print(t)
    a = Table(title=f"agreement with the teacher on the same {report['heldout']} held-out items")
    for col in ("metric", "majority label", "student before", "student after"):
        a.add_column(col)
    for k, v in report["agreement"].items():
        if k == "n":
            continue
        row = [report["baselines"]["majority"].get(k), report["baselines"]["student_before"].get(k), v]
        a.add_row(k, *[f"{x:.3f}" if isinstance(x, float) else str(x) for x in row])
    console.print(a)
