"""Which GPU a run's torch side uses when none is named, and naming the card without starting a framework.
ppo-hidden's engine default is cuda:0 by name (llm-policy's "auto" likewise: tests/test_llm_policy.py), never the
thread's current GPU; `utils.hardware.gpu_name` asks nvidia-smi before any framework. Why: on 2 x H200
(2026-11-29) a bench named its card by starting JAX's GPU client, after which torch's current GPU was cuda:1, and
a "dedicated" row's learner (device "auto") shared its engine's GPU
(bench/results/logs/s45_h200x2_async_dedicated_run1.log). No GPU here: torch's CUDA queries are stood in for."""

from __future__ import annotations

import os
import stat

import torch

from thinkcraft.utils import hardware


def test_ppo_hidden_engine_defaults_to_the_policys_gpu_by_name(monkeypatch) -> None:
    from thinkcraft.train.ppo_hidden.config import PPOHiddenConfig, engine_options

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_options(PPOHiddenConfig())["device"] == "cuda:0"
    assert engine_options(PPOHiddenConfig(engine_device="cuda:1"))["device"] == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "device" not in engine_options(PPOHiddenConfig())


def _fake_smi(tmp_path, monkeypatch, name: str = "NVIDIA H200") -> str:
    """An nvidia-smi on PATH that answers `name` and records its arguments."""
    args = tmp_path / "smi_args.txt"
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f'#!/bin/sh\necho "$@" > {args}\necho "{name}"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    return str(args)


def test_the_card_is_named_without_starting_a_framework(tmp_path, monkeypatch) -> None:
    args = _fake_smi(tmp_path, monkeypatch)
    monkeypatch.setattr(hardware, "_started_name", lambda: None)

    def started(*_):  # noqa: ANN002, ANN202
        raise AssertionError("a framework was asked (and so started on the GPUs) though nvidia-smi answers")

    monkeypatch.setattr(hardware, "_jax_gpu", started)
    monkeypatch.setattr(hardware, "_torch_gpu", started)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert hardware.gpu_name(load=True) == "NVIDIA H200"
    assert "-i 0" in open(args).read()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the first visible GPU, as the frameworks number them
    assert hardware.gpu_name(load=True) == "NVIDIA H200"
    assert "-i 2" in open(args).read()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert hardware.gpu_name(load=True) is None  # no GPU visible


def test_without_nvidia_smi_the_frameworks_answer(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(hardware.shutil, "which", lambda _: None)
    monkeypatch.setattr(hardware, "_started_name", lambda: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(hardware, "_jax_gpu", lambda _: None)
    monkeypatch.setattr(hardware, "_torch_gpu", lambda _: "Some GPU")
    assert hardware.gpu_name(load=True) == "Some GPU"
