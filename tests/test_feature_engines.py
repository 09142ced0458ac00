"""ppo-hidden's feature sources beyond one in-process engine (issue 21, item 2):

* an HTTP engine (`--engine sglang+http://...` against `thinkcraft serve`) learns the model's hidden size
  from the server (`GET /get_model_info`; measured by one request where a server lacks the route);
* `--feature-devices`: the refresh's texts split over K engines (llm/sharded.py) and gathered back in order,
  a raising or silent engine restarted and its shard retried, a run never hanging on one.

The K engines run on the CPU here (each an HFEngine over the same tiny random model); on a GPU machine they
are the same code on cuda:1..K.
"""

from __future__ import annotations

import copy
import json
import threading
import time

import numpy as np
import pytest
import torch

from thinkcraft.cli import main
from thinkcraft.llm.clients import HTTPOptions, SGLangEngine
from thinkcraft.llm.hf import HFEngine
from thinkcraft.llm.protocol import Batch, EngineError
from thinkcraft.llm.serve import make_app
from thinkcraft.llm.sharded import ShardedEngine, median_call_ms, shard_bounds
from thinkcraft.llm.testing import save_tiny, tiny_llama
from thinkcraft.utils.retry import RetryPolicy

FAST = HTTPOptions(retry=RetryPolicy(max_attempts=2, base_delay_s=0.01, max_delay_s=0.1, jitter=0.0))
TINY = ["--env-name", "craftax-classic", "--num-envs", "2", "--num-steps", "8", "--skip-n", "4", "--layer-width",
        "32", "--hidden-proj-dim", "8", "--num-minibatches", "2", "--optimistic-reset-ratio", "1",
        "--total-timesteps", "32", "--no-plot"]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return tiny_llama()


@pytest.fixture(scope="module")
def one(tiny) -> HFEngine:
    return HFEngine.from_model(*tiny)


def fresh(tiny) -> HFEngine:
    """An engine over its own copy of the tiny model (as K engines on K GPUs each hold theirs: engines that
    share one module object race on its per-call settings, e.g. the attention implementation)."""
    return HFEngine.from_model(copy.deepcopy(tiny[0]), tiny[1])


def _batch(n: int) -> Batch:
    return Batch(items=[[5 + i, 6, 7 + 2 * i][: 1 + i % 3] for i in range(n)], prefix=[1, 2, 3])


class Faulty:
    """An engine that raises (`mode` "raise") or hangs ("hang") on its first `faults` hidden-state calls."""

    built = 0

    def __init__(self, inner: HFEngine, mode: str, faults: list[int]) -> None:
        self.inner, self.mode, self.faults = inner, mode, faults
        self.capabilities = inner.capabilities
        self.tokenizer = inner.tokenizer
        self.closed = False
        Faulty.built += 1

    def tokenize_batch(self, batch):
        return self.inner.tokenize_batch(batch)

    def hidden_states_torch(self, batch, layer=-1, pooling="last"):
        if self.faults[0] > 0:
            self.faults[0] -= 1
            if self.mode == "hang":
                threading.Event().wait(30)
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return self.inner.hidden_states_torch(batch, layer, pooling)

    def close(self):
        self.closed = True


def test_shard_bounds_are_contiguous_ordered_and_balanced():
    for n in range(0, 12):
        for k in range(1, 5):
            b = shard_bounds(n, k)
            assert len(b) == k and b[0][0] == 0 and b[-1][1] == n
            assert all(b[i][1] == b[i + 1][0] for i in range(k - 1))
            sizes = [y - x for x, y in b]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_sharded_engine_gathers_every_row_in_the_batch_order(tiny, one):
    """K = 3 engines on the CPU: the gathered (N, H) equals one engine's rows, item by item, for N above,
    at and below K, through the torch and the numpy paths; the tokenizer is engine 0's."""
    eng = ShardedEngine([lambda: fresh(tiny) for _ in range(3)], names=["cpu"] * 3)
    caps = eng.capabilities
    assert caps.hidden_states and not caps.generate and caps.hidden_size == 64 and caps.device_tensors
    assert caps.tokenizer and not caps.sm_partition
    for n in (7, 3, 2):
        want = one.hidden_states_torch(_batch(n))
        got = eng.hidden_states_torch(_batch(n))
        assert got.shape == want.shape == (n, 64)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert eng.hidden_states_torch(Batch(items=[], prefix=[1, 2])).shape == (0, 64)
    texts = Batch(items=["tree (0,+1)", "water", "stone x3 (-1,0)", "cow"], prefix="Observation:\n")
    np.testing.assert_allclose(eng.hidden_states(texts), one.hidden_states(texts), atol=1e-5)
    assert eng.tokenize_batch(texts) == one.tokenize_batch(texts)
    assert eng.restarts == 0
    eng.close()


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_a_dead_engine_is_restarted_and_its_shard_retried(tiny, one, mode):
    """Engine 1 raises (a CUDA fault) or hangs past the timeout on its first call: it is replaced by a new
    engine from its factory, its shard recomputed, the rows still in order; the raising one is closed."""
    faults = [1]  # shared by every engine the slot's factory builds: only the first call fails
    built: list[Faulty] = []

    def factory(k):
        def make():
            e = Faulty(fresh(tiny), mode, faults if k == 1 else [0])
            built.append(e)
            return e
        return make

    eng = ShardedEngine([factory(k) for k in range(3)], timeout_s=1.0, retries=2)
    t0 = time.monotonic()
    got = eng.hidden_states_torch(_batch(6))
    assert time.monotonic() - t0 < 20
    torch.testing.assert_close(got, one.hidden_states_torch(_batch(6)), atol=1e-5, rtol=1e-5)
    assert eng.restarts == 1 and len(built) == 4
    assert built[1].closed == (mode == "raise")  # a hanging engine is abandoned, not closed under it


class Sleepy(Faulty):
    """An engine whose every call takes `seconds` more, waiting without the interpreter lock (as a GPU's
    work does)."""

    def __init__(self, inner: HFEngine, seconds: float) -> None:
        super().__init__(inner, "raise", [0])
        self.seconds = seconds

    def hidden_states_torch(self, batch, layer=-1, pooling="last"):
        time.sleep(self.seconds)
        return self.inner.hidden_states_torch(batch, layer, pooling)


def test_sharded_engine_runs_its_shards_side_by_side_and_times_them(tiny):
    """K engines that each wait 0.5 s per call (a GPU's work, off the interpreter lock): a call takes about one
    engine's time, not K; each engine's seconds and the calls' wall seconds are kept (`shard_s`, `call_s`)."""
    k = 3
    eng = ShardedEngine([lambda: Sleepy(fresh(tiny), 0.5) for _ in range(k)], names=["cpu"] * k)
    for _ in range(2):
        eng.hidden_states_torch(_batch(6))
    assert eng.calls == 2 and all(s >= 1.0 for s in eng.shard_s)
    # K = 3 in sequence would be 3 s; side by side ~1 s, with a second of room for a loaded CI machine
    assert 1.0 <= eng.call_s < 2.0, eng.call_s
    # the calls one by one, and their medians after the first (a warm-up's compiles left out)
    assert len(eng.recent) == 2 and all(len(shards) == k and min(shards) >= 0.5 for _, shards in eng.recent)
    wall_ms, shard_ms = median_call_ms(eng, since=0, skip=1)
    assert wall_ms == round(1000.0 * eng.recent[1][0], 2) and 500 <= min(shard_ms) <= max(shard_ms) <= wall_ms
    assert median_call_ms(eng, since=2) is None and median_call_ms(object()) is None  # no call left; no record
    eng.close()


def test_an_engine_that_keeps_failing_stops_the_call_in_bounded_time(tiny):
    eng = ShardedEngine([lambda: Faulty(fresh(tiny), "hang", [99]) for _ in range(2)],
                        timeout_s=0.3, retries=1, names=["cuda:1", "cuda:2"])
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"feature engine cuda:1 failed 2 time\(s\).*no answer in 0.3 s"):
        eng.hidden_states_torch(_batch(4))
    assert time.monotonic() - t0 < 5


def test_feature_devices_config_checks(capsys):
    base = ["train", "ppo-hidden", *TINY]
    assert main([*base, "--engine", "sglang+http://127.0.0.1:9", "--feature-devices", "cuda:1"]) == 2
    assert "--feature-devices: places in-process hf engines" in capsys.readouterr().err
    assert main([*base, "--feature-devices", "gpu1"]) == 2
    assert "devices are cpu or cuda:N" in capsys.readouterr().err
    assert main([*base, "--feature-devices", "cpu", "--engine-device", "cpu"]) == 2
    assert "replaces --engine-device" in capsys.readouterr().err
    assert main([*base, "--feature-devices", "cuda:7"]) == 2  # no CUDA here (a GPU machine: fewer than 8)
    assert "torch sees" in capsys.readouterr().err
    assert main([*base, "--feature-devices", "cpu", "--feature-timeout-s", "0"]) == 2


def test_http_engine_learns_the_hidden_size_from_the_server(one, servers):
    """`thinkcraft serve` reports hidden_size in SGLang's /get_model_info; a server without the route (a
    real SGLang answers no size either) is measured with one hidden-states request."""
    url = servers.app(make_app(one, "tiny", batch_window_ms=0))
    sg = SGLangEngine(url, options=FAST)
    assert sg.capabilities.hidden_size is None and sg.capabilities.remote_model_info  # no request yet
    info = sg.model_info()
    assert info == {"model_path": "tiny", "hidden_size": 64, "num_hidden_layers": 2}
    assert (sg.capabilities.hidden_size, sg.capabilities.num_layers) == (64, 2)

    from starlette.applications import Starlette

    full = make_app(one, "tiny", batch_window_ms=0)
    bare = Starlette(routes=[r for r in full.routes if r.path != "/get_model_info"])
    bare.state.batcher = full.state.batcher
    sg2 = SGLangEngine(servers.app(bare), options=FAST)
    assert sg2.model_info()["hidden_size"] == 64 and sg2.capabilities.num_layers is None


def test_ppo_hidden_http_engine_sends_the_key_from_env_or_file(one, servers, tmp_path, monkeypatch, capsys):
    """--engine-api-key-env / --engine-api-key-file reach the served engine's requests (a server that wants a
    key answers without one 401); a source that cannot be read, or a key for an in-process engine, is a
    one-line error before anything compiles."""
    from thinkcraft.llm import make_engine
    from thinkcraft.train.ppo_hidden.config import PPOHiddenConfig, engine_options

    url = servers.app(make_app(one, "tiny", api_key="s3cret", batch_window_ms=0))
    monkeypatch.setenv("TC_FEATURE_KEY", "s3cret")
    (tmp_path / "key").write_text("s3cret\n")
    for kw in (dict(engine_api_key_env="TC_FEATURE_KEY"), dict(engine_api_key_file=str(tmp_path / "key"))):
        cfg = PPOHiddenConfig(engine=f"sglang+{url}", engine_timeout_s=30, **kw)
        assert make_engine(cfg.engine, **engine_options(cfg)).model_info()["hidden_size"] == 64
    with pytest.raises(Exception, match="401"):
        make_engine(f"sglang+{url}", options=FAST).model_info()
    base = ["train", "ppo-hidden", *TINY]
    assert main([*base, "--engine", f"sglang+{url}", "--engine-api-key-env", "TC_UNSET_KEY"]) == 2
    assert "--engine-api-key-env: environment variable TC_UNSET_KEY is not set" in capsys.readouterr().err
    assert main([*base, "--engine-api-key-file", str(tmp_path / "key")]) == 2  # the default hf engine
    assert "applies to sglang+http / openai+http engines" in capsys.readouterr().err


def test_ppo_hidden_against_a_dead_server_says_so(capsys):
    assert main(["train", "ppo-hidden", *TINY, "--engine", "sglang+http://127.0.0.1:9", "--runs-dir", "/tmp/tc-dead"]) == 2
    err = capsys.readouterr().err
    assert "could not learn the model's hidden size from the server" in err and "does not report" not in err


@pytest.mark.slow
def test_train_ppo_hidden_end_to_end_against_thinkcraft_serve(tmp_path, tiny, servers):
    """The CLI against `thinkcraft serve` (a process, a random tiny model): the hidden size comes from the
    server, the run trains and logs the LLM phases; then --feature-devices cpu cpu with --overlap, the
    same model in two in-process engines."""
    model_dir = save_tiny(tmp_path / "model", *tiny)
    url = servers.serve("--model", str(model_dir))
    assert main(["train", "ppo-hidden", *TINY, "--engine", f"sglang+{url}", "--runs-dir", str(tmp_path),
                 "--run-name", "http"]) == 0
    cfg = json.loads((tmp_path / "http/config.json").read_text())
    assert cfg["_derived"]["hidden_size"] == 64
    recs = [json.loads(line) for line in (tmp_path / "http/metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and recs[-1]["llm/refreshes"] == 2 and recs[-1]["timing/llm"] > 0
    assert np.isfinite(recs[-1]["losses/total"])
    # thinkcraft plan on this real run: its rate is the run's steady SPS, its LLM pool the run's timing/llm
    from thinkcraft.analysis.plan import measure

    m = measure(cfg, recs)
    assert m.job == "ppo-hidden" and m.rate == recs[1]["sps"]
    feats = {p.name: p for p in m.pools}["features"]
    assert feats.device_s_per_sample == pytest.approx(recs[1]["timing/llm"] / (2 * 8))  # 2 envs x 8 steps
    assert main(["plan", str(tmp_path / "http"), "--target-samples-per-s", "1000"]) == 0

    assert main(["train", "ppo-hidden", *TINY, "--engine", f"hf:{model_dir}", "--feature-devices", "cpu", "cpu",
                 "--overlap", "--runs-dir", str(tmp_path), "--run-name", "k2"]) == 0
    recs = [json.loads(line) for line in (tmp_path / "k2/metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and recs[-1]["hidden/valid_frac"] == 1.0 and np.isfinite(recs[-1]["losses/total"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (none here)")
def test_sharded_engine_on_two_gpus_gathers_onto_the_policy_gpu(tiny):
    """Engines on cuda:0 and cuda:1 (each its own copy of the model), gathered onto cuda:0: equal to one
    engine's rows, on cuda:0, each engine's call made with its own GPU current."""
    want = HFEngine.from_model(copy.deepcopy(tiny[0]).to("cuda:0"), tiny[1]).hidden_states_torch(_batch(9))
    eng = ShardedEngine([lambda d=d: HFEngine.from_model(copy.deepcopy(tiny[0]).to(d), tiny[1])
                         for d in ("cuda:0", "cuda:1")], gather_device="cuda:0", names=["cuda:0", "cuda:1"])
    got = eng.hidden_states_torch(_batch(9))
    assert str(got.device) == "cuda:0" and eng.capabilities.device == "cuda:0"
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
