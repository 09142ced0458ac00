"""`thinkcraft <command>`: one entry point; each command is a module with a dataclass config.

Contract for a command module (see COMMANDS below): it defines a documented `@dataclass` config class
(tyro turns its fields and their docstrings into flags) and a function `run(config) -> Any`.
Modules are imported lazily so that `thinkcraft render` does not import torch, etc.

Shared by every command: the persistent JAX compilation cache (`utils/jaxcache.py`: the first run of a
command compiles, later runs read the compiled programs back; announced once, when the cache is empty),
and a closed stdout (`thinkcraft train ppo --help | head`) ends the command quietly with exit code 141
(128 + SIGPIPE, what a shell reports for a program killed by the broken pipe), not a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Sequence

# command words -> (module, config class, run function, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str, str, str]] = {
    ("demo",): ("thinkcraft.train.demo", "DemoConfig", "run", "short CPU run of the default job (README's first command)"),
    ("train", "ppo"): ("thinkcraft.train.ppo", "PPOConfig", "run", "PPO on Craftax (JAX, Craftax_Baselines defaults)"),
    ("train", "ppo-hidden"): ("thinkcraft.train.ppo_hidden", "PPOHiddenConfig", "run", "PPO whose policy also reads a frozen LLM's hidden state"),
    ("train", "llm-policy"): ("thinkcraft.train.llm_policy", "LLMPolicyConfig", "run", "train the LLM itself as the policy (GRPO/RLOO/REINFORCE/A*-PO)"),
    ("eval",): ("thinkcraft.train.evaluate", "EvalConfig", "run", "run a checkpoint for M episodes; return and achievements"),
    ("compare",): ("thinkcraft.analysis.compare", "CompareConfig", "run", "curves and final IQM/mean with 95% CIs of groups of runs (rliable)"),
    ("plan",): ("thinkcraft.analysis.plan", "PlanConfig", "run", "GPUs per pool (rollout/reward/learner, env/features) for a target rate, from a run's metrics"),
    ("render",): ("thinkcraft.envs.text.cli", "RenderConfig", "run", "print the text observations of a short random rollout"),
    ("serve",): ("thinkcraft.llm.serve", "ServeConfig", "run", "serve the hf engine over OpenAI- and SGLang-compatible HTTP"),
    ("models",): ("thinkcraft.llm.models", "ModelsConfig", "run", "list the models that resolve locally"),
    ("data", "inspect"): ("thinkcraft.data.cli", "InspectConfig", "run_inspect", "summarise a trajectory store"),
    ("data", "export"): ("thinkcraft.data.cli", "ExportConfig", "run_export", "export trajectories as JSONL"),
    ("collect",): ("thinkcraft.label.collect", "CollectConfig", "run", "roll out a policy and write states as Parquet"),
    ("label",): ("thinkcraft.label.pipeline", "LabelConfig", "run", "label items with a local engine or remote providers (resumable)"),
    ("distill",): ("thinkcraft.label.distill", "DistillConfig", "run", "fine-tune a student on teacher labels, then label the rest"),
}

# commands that compile JAX programs (Craftax, PPO): the first run of each is the slow one
COMPILES_JAX = {("demo",), ("train", "ppo"), ("train", "ppo-hidden"), ("eval",), ("render",), ("collect",)}
EXIT_BROKEN_PIPE = 141


def _usage() -> str:
    lines = ["usage: thinkcraft <command> [--help] [options]", "", "commands:"]
    for words, (_, _, _, help_) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<20} {help_}")
    from thinkcraft.utils.jaxcache import cache_dir

    lines += ["", f"Compiled JAX programs are cached in {cache_dir()} ($JAX_COMPILATION_CACHE_DIR):",
              "the first run of a command compiles (minutes for Craftax on a CPU), later runs start fast."]
    return "\n".join(lines)


def _match(argv: Sequence[str]) -> tuple[tuple[str, ...], list[str]] | None:
    for n in (2, 1):
        key = tuple(argv[:n])
        if key in COMMANDS:
            return key, list(argv[n:])
    return None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe surfaces here, not in the interpreter's exit flush
        return code
    except BrokenPipeError:
        # the reader went away (`| head`): drop what is still buffered, quietly (Python docs, "Note on SIGPIPE")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("--version", "version"):
        from thinkcraft import __version__

        print(__version__)
        return 0
    found = _match(argv)
    if found is None:
        groups = sorted({w[0] for w in COMMANDS if len(w) > 1})
        if argv[0] in groups:
            subs = [w[1] for w in COMMANDS if w[0] == argv[0]]
            print(f"thinkcraft {argv[0]}: expected one of: {', '.join(subs)}", file=sys.stderr)
        else:
            print(f"thinkcraft: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    words, rest = found
    mod_name, cfg_name, fn_name, help_ = COMMANDS[words]
    import tyro

    from thinkcraft.utils.errors import UserError
    from thinkcraft.utils.jaxcache import configure_process_cache

    cache_path, cache_first_use = configure_process_cache()  # before the module import: it may import jax
    mod = importlib.import_module(mod_name)
    cfg_cls = getattr(mod, cfg_name)
    prog = "thinkcraft " + " ".join(words)
    try:
        try:
            cfg = tyro.cli(cfg_cls, args=rest, prog=prog, description=help_)
        except SystemExit as e:  # tyro printed the parse/validation error (or --help) itself
            return int(e.code or 0)
        if cache_first_use and words in COMPILES_JAX:
            from thinkcraft.utils.progress import console

            console.print(f"[dim]compiling JAX programs once; cached in {cache_path} for later runs[/dim]",
                          highlight=False)
        result = getattr(mod, fn_name)(cfg)
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted; the last checkpoint and metrics are intact.", file=sys.stderr)
        return 130
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
