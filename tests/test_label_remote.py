"""Remote labelling against a small in-test OpenAI-compatible server whose answers and faults we control.

The server answers deterministically (so packing, re-asking and resume can be checked exactly) and
records every request's arrival time (so rate limits can be measured). End-to-end runs against the
real `thinkcraft serve` with the bundled model are in test_label_serve.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from servers import free_port
from thinkcraft.label.pipeline import LabelConfig, label, read_labels
from thinkcraft.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


class StubState:
    def __init__(self, **opts):
        self.opts = {"fail_every": 0, "fail_status": 500, "retry_after": None, "api_key": None, "delay_s": 0.0,
                     "drop_in_pack": False, "bad_single": set(), **opts}
        self.times: list[float] = []
        self.bodies: list[dict] = []
        self.n = 0
        self.lock = threading.Lock()


def _answer_for(item_text: str) -> dict:
    # deterministic label of one item: the schema is action:string,n:integer
    return {"action": "noop" if "even" in item_text else "do", "n": len(item_text)}


def make_app(state: StubState):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    import asyncio

    async def chat(request):
        body = await request.json()
        o = state.opts
        with state.lock:
            state.n += 1
            n = state.n
            state.times.append(time.monotonic())
            state.bodies.append(body)
        if o["api_key"] and request.headers.get("authorization") != f"Bearer {o['api_key']}":
            return JSONResponse({"error": "bad key"}, status_code=401)
        if o["delay_s"]:
            await asyncio.sleep(o["delay_s"])
        if o["fail_every"] and n % o["fail_every"] == 0:
            headers = {"Retry-After": str(o["retry_after"])} if o["retry_after"] is not None else {}
            return JSONResponse({"error": "injected"}, status_code=o["fail_status"], headers=headers)
        user = body["messages"][-1]["content"]
        items = re.split(r"### Item \d+\n", user)
        if len(items) > 1:  # packed request
            answers = []
            for i, it in enumerate(items[1:], 1):
                if o["drop_in_pack"] and i == 2:
                    continue  # the model "forgot" item 2
                a = _answer_for(it.strip())
                if o["drop_in_pack"] and i == 3:
                    a = {"action": 5}  # malformed item 3
                answers.append({"id": i, **a})
            text = "```json\n" + json.dumps(answers) + "\n```"
        else:
            text = "bad" if user in o["bad_single"] else json.dumps(_answer_for(user))
        usage = {"prompt_tokens": len(user) // 4 + 10, "completion_tokens": len(text) // 4,
                 "prompt_tokens_details": {"cached_tokens": 8}}
        return JSONResponse({"choices": [{"message": {"role": "assistant", "content": text},
                                          "finish_reason": "stop"}], "usage": usage})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture
def stub(servers):
    """A factory `start(**opts) -> (base_url, state)` of stub servers (stopped after the test)."""

    def start(**opts):
        state = StubState(**opts)
        return servers.app(make_app(state)) + "/v1", state

    return start


def write_items(path: Path, n: int, dup: int = 0) -> Path:
    texts = [f"state {i} {'even' if i % 2 == 0 else 'odd'}" for i in range(n)] + [f"state 0 even"] * dup
    pq.write_table(pa.table({"text": texts, "step": list(range(len(texts)))}), path)
    return path


def endpoints_toml(path: Path, *eps: dict) -> Path:
    lines = []
    for e in eps:
        lines.append("[[endpoints]]")
        for k, v in e.items():
            if isinstance(v, dict):  # TOML inline table
                v_s = "{" + ", ".join(f"{kk} = {json.dumps(vv)}" for kk, vv in v.items()) + "}"
            else:
                v_s = json.dumps(v)
            lines.append(f"{k} = {v_s}")
    path.write_text("\n".join(lines) + "\n")
    return path


def cfg(tmp_path, url, n=10, **kw):
    ep = {"name": "stub", "base_url": url, "model": "stub-model", "max_attempts": 4, "timeout_s": 5.0}
    ep.update(kw.pop("ep", {}))
    inp = tmp_path / "items.parquet"
    if not inp.exists():
        write_items(inp, n, dup=kw.pop("dup", 0))
    return LabelConfig(input=str(inp), out_dir=str(tmp_path / "out"), fields="action:string,n:integer",
                       endpoints=str(endpoints_toml(tmp_path / "ep.toml", ep)), **kw)


def _check_labels(out_dir, n):
    t = read_labels(out_dir)
    keys = t.column("key").to_pylist()
    assert len(keys) == len(set(keys)) == n
    for row, pj in zip(t.column("row").to_pylist(), t.column("parsed_json").to_pylist()):
        text = f"state {row} {'even' if row % 2 == 0 else 'odd'}"
        assert json.loads(pj) == _answer_for(text)
    return t


def test_remote_end_to_end_and_resume_skips_done(tmp_path, stub):
    url, st = stub()
    rep = label(cfg(tmp_path, url, n=12, dup=3))
    assert rep["labelled"] == 12 and rep["duplicates_in_input"] == 3 and rep["remaining"] == 0
    assert rep["cached_tokens"] > 0 and rep["tokens_per_s"] > 0
    assert st.n == 12
    # the shared prefix goes first, as the system message, identical in every request (provider caching)
    assert len({b["messages"][0]["content"] for b in st.bodies}) == 1
    assert st.bodies[0]["model"] == "stub-model" and st.bodies[0]["temperature"] == 0.0
    _check_labels(tmp_path / "out", 12)
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["labelled"] == 12
    rep2 = label(cfg(tmp_path, url, n=12))
    assert rep2["already_done"] == 12 and rep2["labelled"] == 0 and st.n == 12


def test_packing_and_reasking(tmp_path, stub):
    url, st = stub(drop_in_pack=True)
    rep = label(cfg(tmp_path, url, n=8, pack_size=4))
    # 2 packs; in each, item 2 is missing and item 3 malformed -> 4 items re-asked alone
    assert rep["reasked"] == 4 and st.n == 2 + 4
    assert rep["labelled"] == 8
    t = _check_labels(tmp_path / "out", 8)
    assert sorted(t.column("pack_size").to_pylist()) == [1] * 4 + [4] * 4


def test_schema_violation_is_reasked_then_reported(tmp_path, stub):
    url, st = stub(bad_single={"state 1 odd"})
    rep = label(cfg(tmp_path, url, n=4, schema_retries=2))
    assert rep["labelled"] == 3 and rep["invalid"] == 1 and rep["errors"] == {"schema": 1}
    assert rep["reasked"] == 2 and st.n == 4 + 2
    fails = [json.loads(x) for x in (tmp_path / "out" / "failures.jsonl").read_text().splitlines()]
    assert fails[0]["row"] == 1 and fails[0]["kind"] == "schema"


def test_rate_limit_honoured(tmp_path, stub):
    url, st = stub()
    rpm = 240  # 4 requests/s, a burst of at most one second's worth
    rep = label(cfg(tmp_path, url, n=12, ep={"rpm": rpm, "max_concurrency": 4}))
    assert rep["labelled"] == 12
    t = st.times
    rate, burst = rpm / 60, max(1, rpm / 60)
    for i in range(len(t)):
        for j in range(i + 1, len(t)):
            # requests in any window of length (t_j - t_i) never exceed burst + rate * window (+1: these are
            # arrival times at the server, and one request's connection setup can delay its arrival)
            assert j - i + 1 <= burst + rate * (t[j] - t[i]) + 1, (i, j, t[j] - t[i])
    assert t[-1] - t[0] >= (12 - burst - 1) / rate - 0.1


def test_5xx_retried_and_429_retry_after(tmp_path, stub):
    url, st = stub(fail_every=3, fail_status=503)
    rep = label(cfg(tmp_path, url, n=9))
    assert rep["labelled"] == 9 and rep["endpoints"]["stub"]["http_5xx"] >= 3
    assert rep["endpoints"]["stub"]["retries"] >= 3
    _check_labels(tmp_path / "out", 9)

    url, st = stub(fail_every=4, fail_status=429, retry_after=2)
    (tmp_path / "b").mkdir()
    rep = label(cfg(tmp_path / "b", url, n=6, ep={"max_concurrency": 1}))
    assert rep["labelled"] == 6 and rep["endpoints"]["stub"]["http_429"] >= 1
    # the request after a 429 waited for Retry-After (2 s); the others did not (a second's room for a loaded
    # CI machine)
    gaps = [st.times[i + 1] - st.times[i] for i in range(len(st.times) - 1)]
    assert gaps[3] >= 1.95 and max(gaps[:3]) < 1.0


def test_bounded_retries_then_reported(tmp_path, stub):
    url, st = stub(fail_every=1, fail_status=503)
    rep = label(cfg(tmp_path, url, n=2, ep={"max_attempts": 2, "max_concurrency": 1}))
    assert rep["labelled"] == 0 and rep["failed"] == 2 and rep["errors"] == {"http_503": 2}
    assert st.n == 4  # 2 items x 2 attempts, no more


def test_plain_500_and_4xx_are_not_retried(tmp_path, stub):
    # a plain 500 is an internal error that the same request meets again: reported at once, not retried
    url, st = stub(fail_every=1, fail_status=500)
    rep = label(cfg(tmp_path, url, n=2, ep={"max_attempts": 4, "max_concurrency": 1}))
    assert rep["failed"] == 2 and rep["errors"] == {"http_500": 2} and st.n == 2
    assert rep["endpoints"]["stub"]["retries"] == 0
    url, st = stub(fail_every=1, fail_status=422)
    (tmp_path / "b").mkdir()
    # --no-constrain: no response_format, so no structured-outputs fallback request (that one is not a retry)
    rep = label(cfg(tmp_path / "b", url, n=1, ep={"max_attempts": 4}, constrain=False))
    assert rep["failed"] == 1 and st.n == 1


def test_key_from_env_or_file(tmp_path, stub, monkeypatch):
    url, st = stub(api_key="right")
    monkeypatch.setenv("TC_LABEL_KEY", "right")
    (tmp_path / "key.txt").write_text("right\n")
    for i, key in enumerate(({"api_key_env": "TC_LABEL_KEY"}, {"api_key_file": str(tmp_path / "key.txt")})):
        (tmp_path / str(i)).mkdir()
        rep = label(cfg(tmp_path / str(i), url, n=2, ep=key))
        assert rep["labelled"] == 2
    bad = endpoints_toml(tmp_path / "bad.toml", {"base_url": url, "model": "m", "api_key_file": str(tmp_path / "nope")})
    with pytest.raises(UserError, match="api_key_file: cannot read"):
        label(LabelConfig(input=str(tmp_path / "0" / "items.parquet"), out_dir=str(tmp_path / "o"), endpoints=str(bad)))


def test_bad_key_stops_that_endpoint_only(tmp_path, stub):
    url_ok, st_ok = stub(api_key="right")
    url_bad, st_bad = stub(api_key="right")
    inp = write_items(tmp_path / "items.parquet", 10)
    eps = endpoints_toml(
        tmp_path / "ep.toml",
        {"name": "good", "base_url": url_ok, "model": "m", "api_key": "right", "weight": 1},
        {"name": "bad", "base_url": url_bad, "model": "m", "api_key": "wrong", "weight": 3},
    )
    rep = label(LabelConfig(input=str(inp), out_dir=str(tmp_path / "out"), fields="action:string,n:integer",
                            endpoints=str(eps)))
    assert rep["labelled"] == 10
    assert "401" in rep["endpoints"]["bad"]["stopped"] and rep["endpoints"]["good"]["stopped"] is None
    assert st_bad.n <= 4  # one request per worker at most, then stopped
    _check_labels(tmp_path / "out", 10)


def test_all_endpoints_down_is_a_clear_error(tmp_path, stub):
    url, _ = stub(api_key="right")
    with pytest.raises(UserError, match="every endpoint stopped.*401"):
        label(cfg(tmp_path, url, n=3, ep={"api_key": "wrong"}))
    dead = f"http://127.0.0.1:{free_port()}/v1"
    (tmp_path / "x").mkdir()
    with pytest.raises(UserError, match="unreachable"):
        label(cfg(tmp_path / "x", dead, n=2, ep={"max_attempts": 2, "max_concurrency": 1}))
    rep = json.loads((tmp_path / "x" / "out" / "report.json").read_text())
    assert rep["errors"]["not_sent"] == 2 and rep["endpoints"]["stub"]["connect_errors"] == 2


def test_weights_share_the_work(tmp_path, stub):
    url_a, st_a = stub()
    url_b, st_b = stub()
    inp = write_items(tmp_path / "items.parquet", 40)
    eps = endpoints_toml(tmp_path / "ep.toml",
                         {"name": "a", "base_url": url_a, "model": "m", "weight": 3, "max_concurrency": 2},
                         {"name": "b", "base_url": url_b, "model": "m", "weight": 1, "max_concurrency": 2})
    rep = label(LabelConfig(input=str(inp), out_dir=str(tmp_path / "out"), endpoints=str(eps)))
    assert rep["labelled"] == 40
    assert (st_a.n, st_b.n) == (30, 10)


def test_bad_inputs(tmp_path, stub):
    url, _ = stub()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="no rows"):
        label(LabelConfig(input=str(empty), out_dir=str(tmp_path / "o"),
                          endpoints=str(endpoints_toml(tmp_path / "e.toml", {"base_url": url, "model": "m"}))))
    j = tmp_path / "items.jsonl"
    j.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(UserError, match="columns \\['nope'\\]"):
        label(LabelConfig(input=str(j), out_dir=str(tmp_path / "o"), item="{nope}",
                          endpoints=str(tmp_path / "e.toml")))
    bad = endpoints_toml(tmp_path / "bad.toml", {"base_url": url, "model": "m", "api_key_env": "NO_SUCH_KEY_VAR"})
    with pytest.raises(UserError, match="NO_SUCH_KEY_VAR"):
        label(LabelConfig(input=str(j), out_dir=str(tmp_path / "o"), endpoints=str(bad)))
    rep = label(LabelConfig(input=str(j), out_dir=str(tmp_path / "o"), endpoints=str(tmp_path / "e.toml")))
    assert rep["labelled"] == 2  # JSONL with a prompt column, free-text output


def test_killed_run_resumes_without_loss_or_duplicates(tmp_path, stub):
    # ~6 s of labelling after start-up (120 items x 0.1 s / 2 workers): wide enough a window for the kill
    # below to land mid-run on a loaded machine (with 1.5 s the whole run sometimes finished first)
    url, st = stub(delay_s=0.1)
    n = 120
    c = cfg(tmp_path, url, n=n, ep={"max_concurrency": 2})
    args = ["label", "--input", c.input, "--out-dir", c.out_dir, "--fields", c.fields, "--endpoints", c.endpoints,
            "--shard-items", "25"]
    code = f"import sys; from thinkcraft.cli import main; sys.exit(main({args!r}))"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    journal = Path(c.out_dir) / "journal.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline:  # kill once some shards and some journal lines exist
        shards = list((Path(c.out_dir) / "shards").glob("part-*.parquet"))
        if shards and journal.exists() and 3 <= journal.read_text().count("\n") < 25:  # 25: a flushed shard's
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    sent_before = st.n
    assert 25 <= sent_before < n
    # the journal had lines when the loop looked; a shard flushed before the kill can have emptied it since
    journaled = journal.exists() and journal.read_text().count("\n") >= 1
    rep = label(c)
    assert rep["recovered_from_journal"] >= (1 if journaled else 0)
    # only requests in flight at the kill are repeated (2 workers -> at most 2)
    assert rep["already_done"] + rep["labelled"] == n
    assert st.n - sent_before == rep["labelled"] and rep["already_done"] >= sent_before - 2
    _check_labels(c.out_dir, n)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_keeps_finished_items(tmp_path, stub):
    url, st = stub(delay_s=0.05)
    n = 40
    c = cfg(tmp_path, url, n=n, ep={"max_concurrency": 1})
    args = ["label", "--input", c.input, "--out-dir", c.out_dir, "--fields", c.fields, "--endpoints", c.endpoints]
    code = f"import sys; from thinkcraft.cli import main; sys.exit(main({args!r}))"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    # SIG_DFL in the child: a test run started in the background (`make test &`) ignores SIGINT, and an
    # ignored SIGINT is inherited through exec (Python then never installs its KeyboardInterrupt handler)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    while st.n < 10:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    t = read_labels(c.out_dir)  # flushed to shards on the way out: no journal left to recover
    assert not (Path(c.out_dir) / "journal.jsonl").exists()
    assert t.num_rows >= 9
    rep = label(c)
    assert rep["already_done"] == t.num_rows and rep["already_done"] + rep["labelled"] == n
    _check_labels(c.out_dir, n)


def test_timeouts_bounded_and_reported(tmp_path, stub):
    url, st = stub(delay_s=0.6)
    rep = label(cfg(tmp_path, url, n=1, ep={"timeout_s": 0.2, "max_attempts": 2, "max_concurrency": 1}))
    assert rep["failed"] == 1 and rep["errors"] == {"timeout": 1}
    assert rep["endpoints"]["stub"]["timeouts"] == 2  # the client's count: both attempts timed out
    # The server's count can lag or miss an attempt: on a loaded machine (CI under xdist) a request the client
    # gave up on after 0.2 s may reach the handler late, or never (the client closed the socket first). What
    # the bound promises is that no third attempt was ever sent.
    deadline = time.monotonic() + 3.0
    while st.n < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 1 <= st.n <= 2


def test_template_file_and_schema_file(tmp_path, stub):
    url, st = stub()
    inp = tmp_path / "items.jsonl"
    inp.write_text('{"obs": "state 0 even", "t": 1}\n{"obs": "state 1 odd", "t": 2}\n')
    tpl = tmp_path / "t.toml"
    tpl.write_text('prefix = "You play Craftax.\\n"\nitem = "{obs}"\nfields = "action:string,n:integer"\n')
    eps = endpoints_toml(tmp_path / "ep.toml", {"name": "stub", "base_url": url, "model": "m"})
    rep = label(LabelConfig(input=str(inp), out_dir=str(tmp_path / "o"), template=str(tpl), endpoints=str(eps)))
    assert rep["labelled"] == 2 and st.bodies[0]["messages"][0]["content"].startswith("You play Craftax.\nAnswer")
    # explicit provider caching marks the shared prefix; extra_body fields are passed through
    eps2 = endpoints_toml(tmp_path / "ep2.toml", {"name": "stub", "base_url": url, "model": "m", "cache_control": True,
                                                  "extra_body": {"prompt_cache_key": "craftax"}})
    label(LabelConfig(input=str(inp), out_dir=str(tmp_path / "o3"), template=str(tpl), endpoints=str(eps2)))
    sys_msg = st.bodies[-1]["messages"][0]["content"]
    assert sys_msg[0]["cache_control"] == {"type": "ephemeral"} and sys_msg[0]["text"].startswith("You play")
    assert st.bodies[-1]["prompt_cache_key"] == "craftax"
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "required": ["action"],
                                  "properties": {"action": {"type": "string", "enum": ["noop"]}}}))
    rep = label(LabelConfig(input=str(inp), out_dir=str(tmp_path / "o2"), item="{obs}", schema=str(schema),
                            endpoints=str(eps), schema_retries=0))
    # the stub answers "do" for odd states: not in the enum -> invalid, reported
    assert rep["labelled"] == 1 and rep["invalid"] == 1
