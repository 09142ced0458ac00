"""Learner -> engine weights over HTTP: `thinkcraft serve`'s /update_weights (full and LoRA, atomic,
versioned, idempotent), the clients for SGLang's and vLLM's own endpoints (request shapes, failures), and a
weight update failing half-way: the engine keeps its old version, says so, and the retry succeeds."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import pytest
import torch
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from thinkcraft.llm.clients import (
    HTTPOptions, SGLangWeightsClient, ThinkcraftWeightsClient, VLLMWeightsClient, weights_client,
)
from thinkcraft.llm.hf import HFEngine
from thinkcraft.llm.protocol import EngineError, SamplingParams
from thinkcraft.llm.serve import make_app
from thinkcraft.llm.testing import save_tiny, tiny_llama
from thinkcraft.pools import EngineFront, EngineSlot, HTTPWeights, SharedWeights, WeightUpdate, trainable_state
from thinkcraft.llm.weight_files import lora_meta, write_hf_weights, write_weight_file
from thinkcraft.utils.retry import RetryPolicy
from test_pools import generate

FAST = HTTPOptions(retry=RetryPolicy(max_attempts=2, base_delay_s=0.01, max_delay_s=0.1, jitter=0.0), timeout_s=30)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def _served(servers, model, tok):
    engine = HFEngine.from_model(copy.deepcopy(model).eval(), tok)
    return engine, servers.app(make_app(engine, "tiny"))


def _close(a, b) -> bool:
    return all(torch.allclose(x.float(), y.float(), atol=1e-6) for x, y in zip(a, b))


def test_serve_update_weights_full_versioned_atomic_idempotent(tiny, servers, tmp_path):
    model, tok = tiny
    engine, url = _served(servers, model, tok)
    learner = copy.deepcopy(model)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.01)
    sync = HTTPWeights(ThinkcraftWeightsClient(url, FAST), tmp_path / "w")
    assert httpx.get(url + "/weights_version").json() == {"version": 0}
    sync.apply(WeightUpdate(3, trainable_state(learner, lora=False)))
    assert sync.version == 3 and httpx.get(url + "/weights_version").json() == {"version": 3}
    assert _close(engine.model.parameters(), learner.parameters())
    # the same version again: answered, nothing to do (a client retrying after a lost answer)
    again = httpx.post(url + "/update_weights", json={"path": str(next((tmp_path / "w").glob("*.pt"))), "version": 3})
    assert again.status_code == 200 and "already" in again.json()["message"]
    # an older version is refused; a file with one bad tensor changes nothing (checked before any copy)
    old = httpx.post(url + "/update_weights", json={"path": "/nonexistent", "version": 2})
    assert old.status_code == 409 and "older" in old.json()["error"]["message"]
    bad_state = {n: torch.zeros_like(p) for n, p in learner.named_parameters()}
    bad_state["model.norm.weight"] = torch.zeros(3)
    path = write_weight_file(tmp_path / "bad.pt", WeightUpdate(4, bad_state))
    r = httpx.post(url + "/update_weights", json={"path": str(path), "version": 4})
    assert r.status_code == 400 and "shape" in r.json()["error"]["message"]
    assert httpx.get(url + "/weights_version").json() == {"version": 3}
    assert _close(engine.model.parameters(), learner.parameters())  # untouched by the refused file


def test_serve_update_weights_lora_adapters_only(tiny, servers, tmp_path):
    from peft import LoraConfig, get_peft_model

    model, tok = tiny
    engine, url = _served(servers, model, tok)
    policy = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                             lora_dropout=0.0))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05)
    state = trainable_state(policy, lora=True)
    assert state and all("lora_" in n for n in state)  # adapters only
    HTTPWeights(ThinkcraftWeightsClient(url, FAST), tmp_path).apply(
        WeightUpdate(1, state, kind="lora", meta=lora_meta(policy)))
    ids = torch.tensor([[1, 50, 51, 52, 53]])
    with torch.no_grad():
        want = policy(input_ids=ids).logits
        got = engine.model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4)
    # a second adapter version is applied to the *base* weights, not on top of the first
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_" in n:
                p.mul_(-1.0)
    HTTPWeights(ThinkcraftWeightsClient(url, FAST), tmp_path, version=1).apply(
        WeightUpdate(2, trainable_state(policy, lora=True), kind="lora", meta=lora_meta(policy)))
    with torch.no_grad():
        assert torch.allclose(engine.model(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-4)


class TornFileClient(ThinkcraftWeightsClient):
    """Writes the file, then (first time only) cuts it in half before the server reads it: a learner killed
    half-way through writing, or a network file system serving a partial file."""

    torn = 0

    def update_weights(self, path, version, kind):
        if not self.torn:
            self.torn += 1
            data = Path(path).read_bytes()
            Path(path).write_bytes(data[: len(data) // 2])
        return super().update_weights(path, version, kind)


def test_weight_update_failing_half_way_keeps_the_old_version_and_retries(tiny, servers, tmp_path, caplog):
    model, tok = tiny
    engine, url = _served(servers, model, tok)
    before = [p.detach().clone() for p in engine.model.parameters()]
    learner = copy.deepcopy(model)
    with torch.no_grad():
        for p in learner.parameters():
            p.mul_(1.5)
    sync = HTTPWeights(TornFileClient(url, FAST), tmp_path)
    slot = EngineSlot(engine, sync)
    front = EngineFront([slot], batch_wait_s=0.0, max_lag=0, update_backoff_s=0.05)
    with caplog.at_level("WARNING"):
        front.publish(WeightUpdate(1, trainable_state(learner, lora=False)))
        comps, version = generate(front, [[1, 50, 51]], [0], SamplingParams(max_new_tokens=2), timeout_s=60)
    # the torn file was refused (the server kept version 0 and its weights), logged, retried, then loaded
    assert "failed" in caplog.text and "keeps version 0" in caplog.text and "retries" in caplog.text
    stats = front.stats()
    assert version == 1 and stats.update_failures == 1
    assert stats.updates == (1,) and stats.update_s[0] > 0  # the failed try is not counted as an update
    assert httpx.get(url + "/weights_version").json() == {"version": 1}
    assert _close(engine.model.parameters(), learner.parameters())
    assert not _close(before, learner.parameters())
    front.stop()


# ------------------------------------------------------------------------- SGLang / vLLM (mock servers)


def _recorder(routes: dict[str, object]):
    seen: list[tuple[str, object]] = []

    def make(path, answer):
        async def handler(request):
            body = await request.json() if request.method == "POST" else None
            seen.append((path, body))
            status, payload = answer(body) if callable(answer) else (200, answer)
            return JSONResponse(payload, status_code=status)
        return handler

    app = Starlette(routes=[Route(p, make(p, a), methods=["GET", "POST"]) for p, a in routes.items()])
    return app, seen


def test_sglang_weights_client_requests_and_refusal(servers, tmp_path, tiny):
    model, tok = tiny
    base = save_tiny(tmp_path / "base", model, tok)
    state = {"version": 0}

    def update(body):
        if body["model_path"].endswith("hf-v00000002"):
            return 200, {"success": False, "message": "Failed to update: shape mismatch"}
        state["version"] = int(body["weight_version"])
        return 200, {"success": True, "message": "Succeeded to update model weights."}

    app, seen = _recorder({"/update_weights_from_disk": update, "/model_info": lambda b: (200, {
        "weight_version": str(state["version"])}), "/load_lora_adapter": {"success": True},
        "/unload_lora_adapter": (lambda b: (400, {"error": "not loaded"}))})
    url = servers.app(app)
    client = SGLangWeightsClient(url, str(base), FAST)
    sync = HTTPWeights(client, tmp_path / "out")
    sync.apply(WeightUpdate(1, trainable_state(model, lora=False)))
    path, body = seen[0]
    assert path == "/update_weights_from_disk" and body["weight_version"] == "1" and body["abort_all_requests"] is False
    folder = Path(body["model_path"])
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert sync.version == 1
    with pytest.raises(EngineError, match="shape mismatch"):
        sync.apply(WeightUpdate(2, trainable_state(model, lora=False)))
    assert sync.version == 1  # refused: the old version stands
    client.update_weights("/adapters/v3", 3, "lora")
    assert seen[-1] == ("/load_lora_adapter", {"lora_name": "policy", "lora_path": "/adapters/v3"})


def test_vllm_weights_client_requests(servers, tmp_path, tiny):
    model, tok = tiny
    app, seen = _recorder({"/collective_rpc": {"results": [None]}, "/v1/load_lora_adapter": {}})
    url = servers.app(app)
    engine, client = weights_client(f"vllm+{url}/v1", str(save_tiny(tmp_path / "base", model, tok)), lora=True,
                                    options=FAST)
    assert isinstance(client, VLLMWeightsClient) and engine.client.model == "policy"  # requests name the adapter
    client.update_weights("/w/hf-v00000004", 4, "full")
    assert seen[-1] == ("/collective_rpc", {"method": "reload_weights", "kwargs": {
        "weights_path": "/w/hf-v00000004", "is_checkpoint_format": True}})
    client.update_weights("/w/hf-v00000005", 5, "lora")
    assert seen[-1] == ("/v1/load_lora_adapter", {"lora_name": "policy", "lora_path": "/w/hf-v00000005",
                                                 "load_inplace": True})
    assert client.weights_version() == 5


def test_hf_adapter_folder_is_a_peft_folder(tiny, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model, tok = tiny
    policy = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.fill_(0.02)
    out = write_hf_weights(WeightUpdate(1, trainable_state(policy, True), "lora", meta=lora_meta(policy)),
                           tmp_path / "hf-v1", str(tmp_path))
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 2
    loaded = PeftModel.from_pretrained(copy.deepcopy(model), str(out))  # PEFT itself reads it back
    ids = torch.tensor([[1, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-5)


def test_unknown_rollout_server_spec_is_a_clear_error():
    from thinkcraft.utils.errors import UserError

    with pytest.raises(UserError, match="thinkcraft\\+http"):
        weights_client("http://x:1", None, lora=False)


def test_shared_weights_version_follows_the_learner():
    s = SharedWeights()
    s.set_version(2)
    s.apply(WeightUpdate(1))
    assert s.version == 2


# ---------------------------------------------------- versioned engines (llm/hf decode engine): stale updates


def _shifted(model, by: float):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(by)
    return m


def test_copy_weights_through_a_versioned_engine_skips_stale_versions(tiny):
    """A copy engine with versioned weights takes updates through its own update_weights; an update it already
    holds (or an older one) is skipped - never an error that would fail the slot - and a bad one still fails
    whole, the engine keeping its weights and version."""
    from thinkcraft.llm.protocol import StaleWeightsError, WeightUpdateError
    from thinkcraft.pools import CopyWeights, engine_update

    model, tok = tiny
    twin = copy.deepcopy(model).eval()
    engine = HFEngine.from_model(twin, tok)
    sync = CopyWeights(twin, 0, engine=engine)
    v2, v3 = _shifted(model, 0.01), _shifted(model, 0.02)
    before = engine.decode_metrics()
    sync.apply(WeightUpdate(2, trainable_state(v2, lora=False)))
    assert sync.version == 2 and engine.weights_version == 2 and _close(twin.parameters(), v2.parameters())
    from thinkcraft.train.llm_policy.rollout import decode_metrics_delta

    took = decode_metrics_delta(before, engine.decode_metrics())  # the update's phases, timed (the engine stood still)
    assert took["engine/weight_copy_s"] > 0 and took["engine/weight_switch_s"] >= 0 <= took["engine/weight_drain_s"]
    # the engine itself refuses an older version, with the typed error ...
    with pytest.raises(StaleWeightsError, match="stale"):
        engine.update_weights(trainable_state(model, lora=False), 1)
    # ... which publishing skips: version 3 reached the engine (an answer lost in a timeout), the retry is a no-op
    engine.update_weights(trainable_state(v3, lora=False), 3)
    sync.apply(WeightUpdate(3, trainable_state(v3, lora=False)))
    assert sync.version == 3 and engine.weights_version == 3
    assert engine_update(engine, trainable_state(v2, lora=False), 2) is False
    assert _close(twin.parameters(), v3.parameters())
    bad = dict(trainable_state(v2, lora=False), **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(WeightUpdateError, match="shape"):
        sync.apply(WeightUpdate(4, bad))
    assert sync.version == 3 and engine.weights_version == 3 and _close(twin.parameters(), v3.parameters())


def test_engine_front_with_a_versioned_engine_ahead_does_not_count_a_failure(tiny):
    """The front publishes a version the engine already holds: applied as a skip, no failure, and the batch
    that follows is labelled with that version."""
    from thinkcraft.pools import CopyWeights

    model, tok = tiny
    twin = copy.deepcopy(model).eval()
    engine = HFEngine.from_model(twin, tok)
    state = trainable_state(_shifted(model, 0.01), lora=False)
    engine.update_weights(state, 5)  # e.g. the same update delivered before by a retry
    front = EngineFront([EngineSlot(engine, CopyWeights(twin, 4, engine=engine))], batch_wait_s=0.0, max_lag=0,
                        update_backoff_s=0.05, max_update_failures=1)
    front.publish(WeightUpdate(5, state))
    comps, version = generate(front, [[1, 50, 51]], [0], SamplingParams(max_new_tokens=2), timeout_s=60)
    assert version == 5 and len(comps) == 1 and front.stats().update_failures == 0 and front.fatal is None
    front.stop()


def test_shared_weights_move_a_versioned_engines_version(tiny):
    """Shared parameters: the learner's version reaches the engine (its tokens record it) with no tensors;
    an engine already ahead is left as it is; a resumed run starts the engine at the checkpoint's version."""
    model, tok = tiny
    engine = HFEngine.from_model(copy.deepcopy(model).eval(), tok)
    s = SharedWeights(0, engine)
    s.set_version(1)
    assert s.version == 1 and engine.weights_version == 1
    engine.update_weights(None, 3)
    s.set_version(2)  # stale for the engine: skipped, not raised
    assert s.version == 2 and engine.weights_version == 3
    resumed = HFEngine.from_model(copy.deepcopy(model).eval(), tok)
    assert SharedWeights(4, resumed).version == 4 and resumed.weights_version == 4


def test_engine_update_skips_a_version_the_engine_has_queued():
    """The engine refuses a version not newer than one queued for its next step boundary (StaleWeightsError
    while its held version is still older): skipped too."""
    from thinkcraft.llm.protocol import Capabilities, StaleWeightsError, WeightUpdateError
    from thinkcraft.pools import engine_update

    class Queued:
        capabilities = Capabilities(hidden_states=False, generate=True, logprobs=True, prefix_reuse=False,
                                    versioned_weights=True)
        weights_version = 1

        def update_weights(self, state, version):
            if version <= 4:  # version 4 is queued
                raise StaleWeightsError(f"stale weight update: version {version} is not newer than 4")
            raise WeightUpdateError("the engine's device is gone")

    assert engine_update(Queued(), None, 3) is False
    with pytest.raises(WeightUpdateError, match="device is gone"):
        engine_update(Queued(), None, 5)


def test_a_copy_engine_with_autocast_weights_samples_what_the_fp32_copy_samples(tiny):
    """`autocast_weights` (a copy engine's linears and embeddings stored in the autocast dtype once, instead of
    cast at every decode step): under bf16 autocast the engine over it generates the fp32 copy's tokens and
    log-probs, norms stay fp32, tied weights stay tied, and an update from the fp32 learner (apply_state)
    keeps the two equal."""
    import copy

    import numpy as np

    from thinkcraft.llm import compat
    from thinkcraft.llm.hf import HFEngine
    from thinkcraft.llm.hf.weights import apply_state, autocast_weights
    from thinkcraft.llm.protocol import Batch, SamplingParams

    model, tok = tiny
    learner = copy.deepcopy(model).float()
    fp32 = copy.deepcopy(learner)
    half = autocast_weights(copy.deepcopy(learner), torch.bfloat16)
    dtypes = {n: p.dtype for n, p in half.named_parameters()}
    assert {d for n, d in dtypes.items() if "norm" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "proj" in n or "embed" in n} == {torch.bfloat16}
    if learner.config.tie_word_embeddings:
        assert half.get_output_embeddings().weight is half.get_input_embeddings().weight
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in ("Hello there", "The quick brown fox")]
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=True)

    def both() -> None:
        out = []
        for m in (fp32, half):
            with compat.autocast(torch.bfloat16, "cpu"):
                out.append(HFEngine.from_model(m, tok).generate(Batch(items=prompts), sp))
        for a, b in zip(*out):
            assert a.token_ids == b.token_ids
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)

    both()
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    for m in (fp32, half):
        apply_state(m, learner.state_dict(), 1)
    assert half.get_input_embeddings().weight.dtype == torch.bfloat16
    both()


def test_a_state_staged_like_a_half_precision_copy_applies_as_the_plain_one(tiny):
    """`trainable_state(..., like=twin)` (the dedicated placement: the learner's thread stages its update where
    and as the engine's copy holds each tensor - bf16 Linear weights, fp32 norms) leaves the copy exactly as the
    fp32 state staged by the engine itself does, and apply_state then makes one copy call per dtype, none per
    tensor."""
    from thinkcraft.llm.hf.weights import apply_state, autocast_weights

    model, _ = tiny
    learner = _shifted(model, 0.01)
    twin_a = autocast_weights(copy.deepcopy(model).eval(), torch.bfloat16)
    twin_b = autocast_weights(copy.deepcopy(model).eval(), torch.bfloat16)
    plain = trainable_state(learner, lora=False, device=None)
    staged = trainable_state(learner, lora=False, like=twin_b)
    held = dict(twin_b.state_dict(keep_vars=True))
    assert {n: t.dtype for n, t in staged.items()} == {n: held[n].dtype for n in staged}
    assert {t.dtype for t in staged.values()} == {torch.bfloat16, torch.float32}  # Linear weights and norms
    assert all(staged[n].data_ptr() != p.data_ptr() for n, p in learner.named_parameters())  # copies, not views
    apply_state(twin_a, plain, 1)
    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):  # the torch calls apply_state makes (each one a release of the GIL on a GPU)
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Calls() as calls:
        apply_state(twin_b, staged, 1)
    made = [n for n in calls.names if n not in ("__get__", "_set_grad_enabled")]
    assert made == ["_foreach_copy_"] * 2, made  # one copy per dtype (bf16 weights, fp32 norms), nothing per tensor
    assert all(torch.equal(a, b) for a, b in zip(twin_a.state_dict().values(), twin_b.state_dict().values()))
    assert not all(torch.equal(a.float(), b) for a, b in zip(twin_b.parameters(), model.parameters()))  # it moved


def test_the_async_weight_update_is_staged_like_copies_on_one_device(tiny):
    """async_build.weight_update stages like the copy engines' model when they all sit on one device (the
    dedicated placement); copies on several devices keep the learner-device snapshot."""
    from types import SimpleNamespace

    from thinkcraft.pools import CopyWeights
    from thinkcraft.train.llm_policy.async_build import weight_update

    model, _ = tiny
    learner = SimpleNamespace(model=_shifted(model, 0.01), cfg=SimpleNamespace(finetune="full"))
    twin = copy.deepcopy(model).eval().to(torch.bfloat16)
    one = [EngineSlot(None, CopyWeights(twin, 0), "engine0-copy", "cpu")]
    assert {t.dtype for t in weight_update(learner, 1, one).state.values()} == {torch.bfloat16}
    two = one + [EngineSlot(None, CopyWeights(copy.deepcopy(twin), 0), "engine1-copy", "meta")]
    assert {t.dtype for t in weight_update(learner, 1, two).state.values()} == {torch.float32}
