"""The engine side of `thinkcraft serve`: one engine call at a time, concurrent requests micro-batched,
each request checked against the model's limits (context, vocabulary, `n`, max tokens) before it runs,
and completions shaped with their token texts and top-k alternatives."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from thinkcraft.llm.protocol import Batch, Completion, SamplingParams
from thinkcraft.llm.serve_requests import ChatRequest, RequestError
from thinkcraft.llm.serve_responses import Shaped, text_pieces


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_new_tokens: int = 4096
    max_n: int = 64
    context_tokens: int | None = None
    """None: the model's (max_position_embeddings)."""


class MicroBatcher:
    """Merges generate requests that arrive within `window_ms` of each other and share sampling
    parameters into one engine call (one padded batch on the accelerator instead of many small ones).
    Completions go back to each request in order; an engine error fails every request of its group."""

    def __init__(self, run: Any, window_ms: float = 5.0, max_items: int = 256) -> None:
        self.run = run  # async (Batch, SamplingParams) -> list[Completion]
        self.window_s = window_ms / 1000.0
        self.max_items = max_items
        self.queue: asyncio.Queue | None = None
        self.worker: asyncio.Task | None = None
        self.engine_calls = 0

    async def generate(self, batch: Batch, sp: SamplingParams) -> list[Completion]:
        # seeded requests run alone: grouping depends on arrival timing and would change their samples
        if self.window_s <= 0 or batch.prefix is not None or sp.seed is not None:
            self.engine_calls += 1
            return await self.run(batch, sp)
        if self.worker is None or self.worker.done():
            self.queue = asyncio.Queue()
            self.worker = asyncio.get_running_loop().create_task(self._work())
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((batch, sp, fut))
        return await fut

    async def _work(self) -> None:
        assert self.queue is not None
        loop = asyncio.get_running_loop()
        while True:
            pending = [await self.queue.get()]
            deadline = loop.time() + self.window_s
            while sum(len(b) * sp.n for b, sp, _ in pending) < self.max_items:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    pending.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            groups: dict[tuple, list] = {}
            for req in pending:
                groups.setdefault((req[1], req[0].is_tokens), []).append(req)
            for (sp, _), reqs in groups.items():
                items = [it for b, _, _ in reqs for it in b.items]
                try:
                    self.engine_calls += 1
                    cs = await self.run(Batch(items=items), sp)
                except Exception as e:  # noqa: BLE001 - handed to each waiting request
                    for _, _, fut in reqs:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                at = 0
                for b, _, fut in reqs:
                    k = len(b) * sp.n
                    if not fut.done():
                        fut.set_result(cs[at : at + k])
                    at += k


def model_facts(engine: Any) -> tuple[int | None, int, bool]:
    """(context length in tokens or None, vocabulary size, has <think>/</think>) of an HFEngine's model,
    read from its transformers config, embeddings and tokenizer (the engine's public attributes)."""
    cfg = engine.model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    ctx = getattr(cfg, "max_position_embeddings", None)  # architectures name it alike, but not all have it
    vocab = int(engine.model.get_input_embeddings().num_embeddings)
    thinking = {"<think>", "</think>"} <= set(engine.tokenizer.get_vocab())
    return (int(ctx) if ctx else None), vocab, thinking


TOPK_LOGITS_BUDGET = 1 << 26
"""Logits (positions x vocabulary) materialised at once for top-k alternatives (256 MB in fp32)."""


def top_alternatives(engine: Any, prompt_ids: Sequence[int], token_ids: Sequence[int], k: int,
                     vocab_size: int) -> list[list[tuple[int, float]]]:
    """Per generated token, the k most likely (token id, logprob) under the model at temperature 1, from
    teacher-forced forwards over prompt + completion (the engine's decode returns the sampled token's
    logprob only). Agrees with the engine's logprobs up to kernel rounding (~1e-5 in fp32). A long
    completion is scored in chunks of positions (each a forward over the prefix it needs) so that its
    logits stay under TOPK_LOGITS_BUDGET."""
    import torch

    if not token_ids or k <= 0:
        return [[] for _ in token_ids]
    full = list(prompt_ids) + list(token_ids)
    p, n = len(prompt_ids), len(token_ids)
    per = max(1, TOPK_LOGITS_BUDGET // vocab_size)
    out: list[list[tuple[int, float]]] = []
    with torch.inference_mode():
        for a in range(0, n, per):
            b = min(n, a + per)
            # the logits at positions p-1+a .. p+b-2 predict generated tokens a .. b-1
            ids = torch.tensor([full[: p + b - 1]], device=engine.device)
            logits = engine.model(input_ids=ids, logits_to_keep=b - a).logits[0].float()
            vals, idx = torch.log_softmax(logits, -1).topk(k, dim=-1)
            out.extend(list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist()))
    return out


class ServedEngine:
    """The engine behind the routes: one engine call at a time, request checks against the model's limits,
    and the completions shaped for the API."""

    def __init__(self, engine: Any, limits: Limits, batch_window_ms: float) -> None:
        self.engine = engine
        self.limits = limits
        ctx, self.vocab_size, self.thinking = model_facts(engine)
        self.context_tokens = limits.context_tokens or ctx
        self.lock = threading.Lock()  # the engine is not re-entrant
        self.batcher = MicroBatcher(lambda b, sp: self.call(engine.generate, b, sp), batch_window_ms)

    async def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in a worker thread, holding the engine lock. The tokenizer is used under it
        too: a fast tokenizer shared by threads can fail ("Already borrowed") when one encodes while
        another changes its truncation/padding state."""

        def locked() -> Any:
            with self.lock:
                return fn(*args, **kwargs)

        return await asyncio.to_thread(locked)

    async def tokenize(self, items: list[str] | list[list[int]]) -> list[list[int]]:
        if items and isinstance(items[0], str):
            return (await self.call(self.engine.tokenize_batch, Batch(items=items)))[1]
        return [list(p) for p in items]

    async def chat_prompt(self, req: ChatRequest) -> list[int]:
        kwargs = req.chat_template_kwargs or {}
        try:
            return await self.call(self.engine.apply_chat_template, req.template_messages(),
                                   add_generation_prompt=True, tokenize=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - the template's own complaint (jinja, bad kwargs) about this input
            raise RequestError(f"the chat template rejected the request: {e}",
                               "chat_template_kwargs" if kwargs else "messages") from None

    def sampling(self, req: Any, prompts: list[list[int]], prompt_param: str, default_max: int | None) -> SamplingParams:
        """The request's SamplingParams once its prompts, `n` and max tokens fit this server and model.
        `default_max`: max tokens when the request gives none (None: the rest of the context)."""
        lim, ctx = self.limits, self.context_tokens
        if req.samples > lim.max_n:
            raise RequestError(f"{req.n_param}={req.samples} exceeds this server's limit of {lim.max_n} samples "
                               "(thinkcraft serve --max-n)", req.n_param)
        name, budget = req.thinking_field
        if budget is not None and not self.thinking:
            raise RequestError(f"{name} needs a model whose tokenizer has <think> and </think>", name,
                               code="unsupported_parameter")
        for p in prompts:
            if not p:
                raise RequestError(f"{prompt_param}: a prompt is empty (no tokens)", prompt_param)
            bad = next((t for t in p if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"{prompt_param}: token id {bad} is outside the vocabulary "
                                   f"(0..{self.vocab_size - 1})", prompt_param)
        longest = max(len(p) for p in prompts)
        if ctx is not None and longest >= ctx:
            raise RequestError(f"This model's maximum context length is {ctx} tokens, and the prompt has {longest}: "
                               f"shorten the {prompt_param}", prompt_param, code="context_length_exceeded")
        room = (ctx - longest) if ctx is not None else lim.max_new_tokens
        name, asked = req.max_tokens_field
        if asked is None:
            return req.sampling(min(default_max or room, room, lim.max_new_tokens))
        if asked > lim.max_new_tokens:
            raise RequestError(f"{name}={asked} exceeds this server's limit of {lim.max_new_tokens} "
                               "(thinkcraft serve --max-new-tokens-limit)", name)
        if asked > room:
            raise RequestError(f"This model's maximum context length is {ctx} tokens. However, you requested "
                               f"{longest + asked} tokens ({longest} in the prompt, {asked} for the completion): "
                               f"reduce the {prompt_param} or {name}", name, code="context_length_exceeded")
        return req.sampling(asked)

    async def shaped(self, cs: list[Completion], top_k: int, text: bool) -> list[Shaped]:
        """Completions with their token texts and pieces (`text`: for logprobs or a stream) and top-k."""
        tops = None
        if top_k:
            tops = await self.call(lambda: [
                top_alternatives(self.engine, c.prompt_token_ids, c.token_ids, top_k, self.vocab_size) for c in cs
            ])
        tok = self.engine.tokenizer

        def build() -> list[Shaped]:
            decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731 - as the engine decodes
            out = []
            for i, c in enumerate(cs):
                strs = tok.batch_decode([[t] for t in c.token_ids]) if text else []
                pieces = text_pieces(decode, c.token_ids, c.text) if text else []
                top = None
                if tops is not None:
                    top = [[(tok.decode([t]), lp) for t, lp in alts] for alts in tops[i]]
                out.append(Shaped(i, c, strs, pieces, top))
            return out

        return await self.call(build)
