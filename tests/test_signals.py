"""SIGTERM is Ctrl-C (issue 17 item 3): the shared helper, and `label` / `collect` under SIGTERM. The training
commands' SIGTERM runs (subprocesses) are in test_train_ppo.py and test_llm_policy.py."""

import json
import os
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from thinkcraft.cli import main
from thinkcraft.llm.protocol import Completion
from thinkcraft.utils.signals import StopRequest, sigterm_as_interrupt


def test_stop_request_turns_the_first_signal_into_a_flag_and_the_second_into_an_abort():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopRequest("stopping") as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_sigterm_as_interrupt_runs_the_ctrl_c_cleanup_and_returns_0(capsys):
    cleaned = []

    @sigterm_as_interrupt("run it again to continue")
    def command():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("SIGTERM should have interrupted")
        except KeyboardInterrupt:
            cleaned.append(True)
            raise

    before = signal.getsignal(signal.SIGTERM)
    assert command() == 0 and cleaned == [True]
    assert "SIGTERM: stopped; run it again to continue" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before


class _TermOnSecondBatch:
    """A local engine that answers `{"action": <item>}` and is preempted (SIGTERM) during its second batch."""

    def __init__(self, term: bool):
        self.term, self.calls = term, 0

    def generate(self, batch, sampling):
        self.calls += 1
        if self.term and self.calls == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return [Completion(token_ids=[1], text=json.dumps({"action": it}), logprobs=None, finish_reason="stop",
                           prompt_token_ids=[0]) for it in batch.items]

    def close(self):
        pass


def test_label_under_sigterm_keeps_its_journal_exits_0_and_continues(tmp_path, monkeypatch, capsys):
    import thinkcraft.label.pipeline as pipeline

    inp = tmp_path / "items.parquet"
    pq.write_table(pa.table({"text": [f"s{i}" for i in range(12)]}), inp)
    args = ["label", "--input", str(inp), "--out-dir", str(tmp_path / "o"), "--fields", "action:string",
            "--batch-size", "4", "--engine", "hf:fake", "--prompt-format", "raw"]  # a fake engine: no tokenizer to read
    monkeypatch.setattr(pipeline, "make_local_engine", lambda spec: _TermOnSecondBatch(term=True))
    assert main(args) == 0
    assert "SIGTERM: stopped" in capsys.readouterr().err
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    # report.json is cumulative (label/report.py): this run is its last entry
    assert report["last_run"]["interrupted"] and report["labelled"] == 4  # the first batch is in the journal
    monkeypatch.setattr(pipeline, "make_local_engine", lambda spec: _TermOnSecondBatch(term=False))
    assert main(args) == 0
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["already_done"] == 4 and report["last_run"]["labelled"] == 8
    assert report["labelled"] == 12 and report["unlabelled"] == 0


@pytest.mark.slow
def test_collect_under_sigterm_stops_after_the_call_in_flight(tmp_path, monkeypatch):
    # the shapes of test_label_collect.py's collect (one Classic compile, shared through the cache)
    real_write = pq.write_table
    sent = []

    def write_then_term(*a, **k):
        real_write(*a, **k)
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))

    monkeypatch.setattr(pq, "write_table", write_then_term)
    out = tmp_path / "states"
    assert main(["collect", "--out", str(out), "--env-name", "Craftax-Classic-Symbolic-v1", "--num-envs", "2",
                 "--num-steps", "6", "--steps-per-call", "3", "--every", "2", "--seed", "3"]) == 0
    report = json.loads((out / "_collect.json").read_text())
    assert report["interrupted"] and report["shards"] == 1 and report["num_steps"] == 3
    assert pq.read_table(out).column("step").to_pylist() == [0, 0, 2, 2]


def test_the_handler_writes_its_line_without_the_rich_console(monkeypatch, capfd):
    """The first signal's line is a plain write to fd 2: the handler can run inside rich's own print (a first
    print imports rich's emoji table; a re-entrant import failed and the command exited 1 instead of 0)."""
    import os
    import signal

    from thinkcraft.utils import signals

    def reentered(*a, **k):
        raise ImportError("cannot import name 'EMOJI' from partially initialized module (injected)")

    monkeypatch.setattr(signals.console, "print", reentered)
    with signals.StopRequest("stopping after the step in flight") as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.name == "SIGTERM"
    assert "SIGTERM: stopping after the step in flight; send it again to abort now" in capfd.readouterr().err
