"""The batcher's iteration: admit (prefill packed), launch (sample, advance, one-token forward), collect
(read the previous iteration's record, finish rows). See `batcher.py` for the order and why."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from thinkcraft.llm import compat
from thinkcraft.llm.constrained import prompt_in_thought
from thinkcraft.llm.hf.cache import _WIDTH_BUCKET, Seq, _round_up
from thinkcraft.llm.hf.prefill_graphs import PrefillCall, PrefillGraphs, padded_forward, prefill_pad_on
from thinkcraft.llm.hf.rows import sample_rows_lse, token_logprobs
from thinkcraft.llm.hf.slot_table import PARKED, reuse_len
from thinkcraft.llm.hf.slots import DecodeCtx, FlashPrefill, PrefillCtx, prefill_kernel
from thinkcraft.llm.protocol import Completion, GenerationResult
from thinkcraft.utils.transfer import to_device

log = logging.getLogger(__name__)


class IterationMixin:
    """`Batcher`'s per-step half (reads the cache's state from `CacheMixin` and the scheduler's queue, table,
    counters and version)."""

    # ------------------------------------------------------------------------------------------- admit

    def _admit(self) -> None:
        with self._cv:
            if not self._queue:
                return
        self._check_shared_weights()
        self._ensure_kv()
        kv, budget = self.kv, self.eng.max_batch_tokens
        # the keys a chunk reads are bounded only where they are gathered (copied per layer); read in place
        # (`FlashPrefill`) they cost no memory, and a turn of long kept episodes is one call, not two or three
        key_budget = 4 * budget if self._flash_prefill is None or self._prefill_traced() else float("inf")
        chunk: list[tuple[Seq, int, int]] = []  # (seq, slot, kept columns)
        new_tokens = key_tokens = 0
        while True:
            with self._cv:
                if not self._queue:
                    break
                seq = self._queue[0]
                offset = self._prefix_for(seq, chunk)
                if len(seq.prompt) - offset + seq.req.sampling.max_new_tokens > kv.tokens:
                    break  # waits until the cache can grow (nothing running)
                slot = self.table.take(seq.req.episode)
                if slot is None:
                    break
                self._queue.popleft()
                keep, fallback = 0, False
                if self.table.status[slot] == PARKED:
                    keep, fallback = reuse_len(self.table, slot, seq.prompt, offset, self.version)
                self.table.run(slot, seq.req.episode, offset)
            seq.slot, seq.offset, seq.fallback = slot, offset, fallback
            seq.reused_tokens = offset + keep
            seq.prefill_tokens = len(seq.prompt) - seq.reused_tokens
            n_new, n_keys = seq.prefill_tokens, keep + seq.prefill_tokens + offset
            if chunk and (new_tokens + n_new > budget or key_tokens + n_keys > key_budget):
                self._prefill(chunk)
                chunk, new_tokens, key_tokens = [], 0, 0
            chunk.append((seq, slot, keep))
            new_tokens, key_tokens = new_tokens + n_new, key_tokens + n_keys
        if chunk:
            self._prefill(chunk)

    def _prefix_for(self, seq: Seq, chunk: list) -> int:
        """The shared-prefix length this request's columns start after: its `prefix_len` when that prefix is
        the installed one (or can be installed: no running or parked row reads the old one), else 0."""
        p = seq.req.prefix_len
        if p <= 0 or not self.eng.prefix_reuse or p > self.kv.prefix_cap:
            return 0
        pre = seq.prompt[:p]
        if self._prefix is not None and len(self._prefix) == p and np.array_equal(self._prefix, pre):
            return p
        if self.table.uses_prefix() or any(s.offset > 0 for s, _, _ in chunk):
            return 0
        self.kv.set_prefix(self.eng._prefix_kv(pre.tolist()))
        self._prefix = pre
        self.prefix_mask.copy_((self.kv.pcols < p)[None, :].expand_as(self.prefix_mask))
        return p

    def _prefill(self, chunk: list[tuple[Seq, int, int]]) -> None:
        """Prefill the new tokens of `chunk`'s rows packed into one sequence; their last logits join the batch
        and their slots' device state is set."""
        eng, kv = self.eng, self.kv
        dev = eng.device
        slots = np.array([s for _, s, _ in chunk], dtype=np.int64)
        keep = np.array([k for _, _, k in chunk], dtype=np.int64)
        offs = np.array([q.offset for q, _, _ in chunk], dtype=np.int64)
        news = [q.prompt[q.offset + k:] for q, _, k in chunk]
        n_new = np.array([len(x) for x in news], dtype=np.int64)
        total = keep + n_new
        tok_slot = np.repeat(slots, n_new)
        tok_col = np.concatenate([np.arange(k, t) for k, t in zip(keep, total)])
        ids_h, pos_h = np.concatenate(news), tok_col + np.repeat(offs, n_new)
        p = kv.prefix_len if (offs > 0).any() else 0
        cu_q = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
        t = lambda a: to_device(a, dev)  # noqa: E731
        traced = self._prefill_traced()
        if self._dtiming is not None:
            self._dtiming.start("prefill")
        logits = None
        in_place = self._flash_prefill is not None and not traced
        graphs = self._prefill_graphs() if in_place else None
        call = PrefillCall(ids_h, pos_h, tok_slot, tok_col, cu_q, slots, total, (offs > 0) if p else None) \
            if in_place else None
        if graphs is not None:  # a replay (prefill_graphs.py), or None: too large, or the graphs are off
            logits = graphs.run(call, kv, p, self._flash_prefill, self._weights_key)
            self._graph_counters(graphs)
        # eager over a bucket's token count (its GEMMs' rows); the switch read at each call (the bench's --variants)
        if logits is None and in_place and prefill_pad_on():
            logits, pads = padded_forward(self._prefill_forward(), call, kv, p, self._flash_prefill, self.eng.pad_id,
                                          dev)
            self.counters["prefill_pad_tokens"] += float(pads)
        if logits is None:
            logits = self._prefill_eager(ids_h, pos_h, tok_slot, tok_col, cu_q, slots, total, n_new, offs, p, traced)
        idx = t(slots)
        self.logits[idx] = logits
        self._start_rows(chunk, slots, total, offs)
        if self._dtiming is not None:
            self._dtiming.end()
        self.counters["prefill_tokens"] += float(n_new.sum())
        self.counters["prefill_calls"] += 1.0
        self.counters["reused_tokens"] += float(sum(q.reused_tokens for q, _, _ in chunk))
        self.counters["fallbacks"] += float(sum(q.fallback for q, _, _ in chunk))

    def _prefill_eager(self, ids_h: np.ndarray, pos_h: np.ndarray, tok_slot: np.ndarray, tok_col: np.ndarray,
                       cu_q: np.ndarray, slots: np.ndarray, total: np.ndarray, n_new: np.ndarray, offs: np.ndarray,
                       p: int, traced: bool) -> torch.Tensor:
        """`_prefill`'s forward launched op by op (or traced): the rows' (B, V) logits."""
        kv, dev = self.kv, self.eng.device
        # every host array goes over without a stream sync (utils/transfer.py): a blocking copy here waited for
        # the decode step in flight
        t = lambda a: to_device(a, dev)  # noqa: E731
        flash = None
        if self._flash_prefill is not None and not traced:
            flash = self._flash_prefill_args(slots, total, n_new, offs, p)
            keys: tuple = (None, None, None, None, flash.max_k, flash.kernel)
        else:
            keys = self._gather_args(slots, total, offs, p, traced)
        gather_slot, gather_col, key_index, cu_k, max_k, kernel = keys
        ctx = PrefillCtx(kv.keys, kv.values, kv.prefix_keys if p else None, kv.prefix_values if p else None, p,
                         t(tok_slot), t(tok_col), gather_slot, gather_col, key_index, t(cu_q), cu_k, int(n_new.max()),
                         max_k, kernel, flash)
        return self._prefill_forward()(t(ids_h)[None], t(pos_h)[None], ctx, t(cu_q[1:].astype(np.int64) - 1))

    def _graph_counters(self, graphs: PrefillGraphs) -> None:
        c = self.counters
        c["prefill_graph_captures"], c["prefill_graph_capture_s"] = float(graphs.captures), graphs.capture_s
        c["prefill_graph_replays"], c["prefill_graph_declined"] = float(graphs.replays), float(graphs.declined)
        c["prefill_graph_failed"] = float(graphs.failed)

    def _gather_args(self, slots: np.ndarray, total: np.ndarray, offs: np.ndarray, p: int, traced: bool) -> tuple:
        """The gathered prefill's (gather_slot, gather_col, key_index, cu_k, max_k, kernel): every row's columns
        after the write, and the prefix before them for the rows that read it, packed as one key sequence a row."""
        dev = self.eng.device
        gather_col = np.concatenate([np.arange(t) for t in total])
        gather_slot = np.repeat(slots, total)
        key_index = None
        k_len = total + np.where(offs > 0, p, 0)
        if p:
            starts = np.concatenate([[0], np.cumsum(total)[:-1]]) + p
            key_index = to_device(np.concatenate([
                np.concatenate([np.arange(p) if o > 0 else np.zeros(0, np.int64), np.arange(s, s + t)])
                for o, s, t in zip(offs, starts, total)]), dev)
        cu_k = np.concatenate([[0], np.cumsum(k_len)]).astype(np.int32)
        return (to_device(gather_slot, dev), to_device(gather_col, dev), key_index, to_device(cu_k, dev),
                int(k_len.max()), prefill_kernel(dev, self.kv.dtype, traced))

    def _flash_prefill_args(self, slots: np.ndarray, total: np.ndarray, n_new: np.ndarray, offs: np.ndarray,
                            p: int) -> FlashPrefill:
        """`FlashPrefill` for a chunk: where each row's slot starts in the cache viewed as rows, its column
        count after the write, and the shared prefix's call where some row reads it - one host-to-device copy."""
        kv = self.kv
        hkv, cols = kv.keys[0].shape[1], kv.keys[0].shape[2]
        rows = (kv.slots - 1) * hkv * cols + cols  # attention.slot_rows's row count
        n = int(n_new.sum())
        ints = np.concatenate([slots * hkv * cols, [rows], total, [0, n, 0, kv.prefix_keys[0].shape[2], max(p, 1)]])
        dev = to_device(ints.astype(np.int32), self.eng.device)
        b = len(slots)
        starts, used, meta = dev[:b + 1], dev[b + 1:2 * b + 1], dev[2 * b + 1:]
        reads = to_device(np.repeat(offs > 0, n_new), self.eng.device) if p else None
        prefix_meta = (meta[0:2], meta[2:4], meta[4:5]) if p else None
        return FlashPrefill(self._flash_prefill, starts, used, int(total.max()), prefix_meta, reads)

    def _start_rows(self, chunk: list[tuple[Seq, int, int]], slots: np.ndarray, length: np.ndarray,
                    offs: np.ndarray) -> None:
        """Device and host state of freshly prefilled rows: active from the next iteration on."""
        eng = self.eng
        sps = [q.req.sampling for q, _, _ in chunk]
        think_open, think_close = eng.think_open_id, eng.think_close_id
        in_think = [prompt_in_thought(q.prompt, think_open, think_close) for q, _, _ in chunk]
        budget = [sp.thinking_budget if sp.thinking_budget is not None else 1 << 40 for sp in sps]
        ints = np.stack([np.ones(len(slots)), np.zeros(len(slots)), [sp.max_new_tokens for sp in sps], in_think,
                         np.zeros(len(slots)), budget, -np.ones(len(slots)), np.zeros(len(slots)), length, offs], 1)
        floats = np.array([[sp.temperature, sp.top_p] for sp in sps], dtype=np.float32)
        dev = eng.device
        idx = to_device(slots, dev)
        iv = to_device(ints.astype(np.int64), dev)
        fv = to_device(floats, dev)
        st = self.state
        for j, name in enumerate(("active", "n_gen", "max_new", "in_think", "think_tokens", "budget", "force_pos",
                                  "truncated", "length", "offset")):
            tgt = getattr(st, name)
            tgt[idx] = iv[:, j].to(tgt.dtype)
        st.temperature[idx] = fv[:, 0]
        st.top_p[idx] = fv[:, 1]
        p = self.kv.prefix_len
        self.prefix_mask[idx] = (self.kv.pcols[None, :] < p) & (to_device(offs, dev) > 0)[:, None]
        self._grow_host(max(sp.max_new_tokens for sp in sps))
        self.h_run[slots] = True
        self.h_admit[slots] = self._iter
        self.h_n[slots] = 0
        self.h_len[slots] = length
        self.h_temp[slots] = floats[:, 0]
        self.h_topp[slots] = floats[:, 1]
        self.h_wantlp[slots] = [sp.logprobs for sp in sps]
        self.h_stop[slots] = [bool(sp.stop) for sp in sps]
        self.h_max[slots] = [sp.max_new_tokens for sp in sps]
        for (q, s, _), thinking in zip(chunk, in_think):
            q.versions = [(0, self.version)]
            self._slot_seq[s] = q
            if q.req.sampling.structured is not None:  # structured outputs: the row's constraint starts (after
                self.guides.open(s, q.req.sampling.structured, after_thought=thinking)  # its thought, if open)

    # ------------------------------------------------------------------------------------------ launch

    def _launch(self) -> bool:
        if self.kv is None:
            return False
        k = self._iter
        rows = self.h_run & (self.h_admit <= k)
        if not rows.any():
            return False
        if self._skip_ended and self._ends_in_flight(rows, k):
            self.counters["launches_skipped"] += 1
            return False
        kv = self.kv
        any_sampled = bool((self.h_temp[rows] > 0).any())
        any_top_p = bool((self.h_topp[rows] < 1).any())
        guided = self.guides.any_open(rows)  # structured outputs: sample from the masked logits
        want_lp = bool(self.h_wantlp[rows].any())
        self.h_len[rows] += 1
        width = kv.tokens
        if self.width == "dynamic":
            width = min(kv.tokens, _round_up(int(self.h_len[self.h_run].max()) + 1, _WIDTH_BUCKET))
        use_prefix = kv.prefix_len > 0 and bool(self.table.uses_prefix())
        out = None
        timing = self._dtiming
        if timing is not None:
            timing.start("decode")
        # the whole iteration as one CUDA graph replay (cache.py `_manual_graph_step`) where no host decision is
        # needed inside it: no grammar masks, no per-call seeded generator (a graph replays the default one's)
        if self._fused_fn is not None and not guided and self.gen is None:
            out = self._fused_fn(width, use_prefix, any_sampled, any_top_p, want_lp)  # None: it failed, for good
        if out is None:
            self._launch_unfused(k, width, use_prefix, any_sampled, any_top_p, want_lp, guided)
        else:
            self._hand_record(k, *out)
        if timing is not None:
            timing.end()
        self._iter += 1
        return True

    def _ends_in_flight(self, rows: np.ndarray, k: int) -> bool:
        """Whether every running row samples its last allowed token (`max_new_tokens`) in an iteration already
        launched and not read yet: iteration k would then compute nothing any row keeps, so it is not launched (the
        caller drains the records instead). Why: the host reads a record one iteration late (`_collect`), and it
        used to launch one more full decode iteration after every row of a turn had ended by length - one in 33
        of the Craftax rollout's iterations at 32-token actions, ~2.7 ms each on an H100 (its device timing counted
        264 iterations a rollout for 256 steps read). Rows that end by EOS or a stop string are not known ahead;
        where any row could still go on, the iteration runs as before. THINKCRAFT_SKIP_ENDED_LAUNCH=0: always
        launched (`batcher.skip_ended_launches`)."""
        idx = np.flatnonzero(rows)
        in_flight = k - np.maximum(self._collected, self.h_admit[idx])  # launched, unread iterations that hold it
        return bool((self.h_n[idx] + np.maximum(in_flight, 0) >= self.h_max[idx]).all())

    def _launch_unfused(self, k: int, width: int, use_prefix: bool, any_sampled: bool, any_top_p: bool,
                        want_lp: bool, guided: bool) -> None:
        """The iteration step by step: sampling and bookkeeping launched from here, then the forward."""
        kv, st = self.kv, self.state
        sample_from = self.guides.masked(self.logits) if guided else self.logits
        tok, lse = sample_rows_lse(sample_from, st.temperature, st.top_p, any_sampled, any_top_p, self.gen,
                                   self._sample_seed)
        step = self._advance(st, tok, self._think_tokens(), kv.tokens)
        if want_lp:
            masked = sample_from is not self.logits  # (only rows still thinking: nothing masked this step)
            lp = token_logprobs(self.logits, step.tokens, None if masked else lse)
            rows = self.h_run & (self.h_admit <= k)
            if masked and self.guides.constrained_lp[rows].any():  # structured outputs: "constrained" log-probs
                lpc = token_logprobs(sample_from, step.tokens, lse)
                lp = torch.where(to_device(self.guides.constrained_lp, lp.device), lpc, lp)
        else:
            lp = self._no_lp
        if guided:  # structured outputs: the matchers accept this step's tokens before the next mask
            self.guides.advance(step.tokens, ~step.state.in_think & (step.state.force_pos < 0))
        self._hand_record(k, step.record, lp)
        if self._fused_fn is not None:  # the fused graph reads the state's buffers: they stay where they are
            for dst, src in zip(self.state, step.state):
                if src is not dst:
                    dst.copy_(src)
        else:
            self.state = step.state
        ctx = DecodeCtx(kv.keys, kv.values, kv.prefix_keys if use_prefix else None,
                        kv.prefix_values if use_prefix else None, kv.rows, step.write_col, step.key_len,
                        kv.cols[:width], self.prefix_mask, self._flash, self._split)
        self.logits = self._step_fn(step.tokens[:, None], step.pos[:, None], ctx)

    def _launch_ahead(self) -> int:
        """After a step's iteration, up to `decode_ahead() - 1` more before the host reads any record (opt-in,
        THINKCRAFT_DECODE_AHEAD): the rows' ends, the thinking budget and the tokens are all decided on the device,
        so the host only has to read the records later - in order, as `_collect` does - and the step's fixed host
        work (contexts, update and admission checks, the copies' refresh) is paid once per block. Not where the
        host must act between two iterations: queued requests or weight updates (they wait for the next step),
        rows with stop strings (the host cuts them), grammar-constrained rows (host-side masks). Rows that end inside
        a block idle on the device until the host reads their end (a few iterations). Returns the extra launches."""
        extra = 0
        for _ in range(self._ahead - 1):
            run = self.h_run
            if self._queue or self._updates or bool(self.h_stop[run].any()) or self.guides.any_open(run):
                break
            if not self._launch():
                break
            extra += 1
        self.counters["ahead_launches"] += extra
        return extra

    def _hand_record(self, k: int, record: torch.Tensor, lp: torch.Tensor) -> None:
        """Iteration k's record and log-probs to the host (non-blocking, into pinned buffer k % ring), and an event
        `_collect` waits on (the ring holds every iteration not read yet: two, or one more than a block ahead)."""
        buf = k % len(self._rec_host)
        self._rec_host[buf].copy_(record, non_blocking=True)
        self._lp_host[buf].copy_(lp, non_blocking=True)
        if self.eng.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.eng.device))  # the engine's GPU, whatever the thread's current one
            self._events[buf] = ev

    # ----------------------------------------------------------------------------------------- collect

    def _collect(self, drain: bool) -> None:
        """Read the records of finished iterations (all of them with `drain`, else all but the newest, which
        the device is still computing) and finish the rows that ended."""
        if self.kv is None:
            return
        while self._collected < self._iter - (0 if drain else 1):
            k = self._collected
            buf = k % len(self._rec_host)
            if self._events[buf] is not None:
                t_wait = time.perf_counter()
                self._events[buf].synchronize()
                # the host waiting for the device: the rest of a step's wall time is host work (or the GIL)
                self._device_wait_s += time.perf_counter() - t_wait
            if self._dtiming is not None:
                self._dtiming.harvest(self.counters)
            rows = np.flatnonzero(self.h_run & (self.h_admit <= k))
            self._collected += 1
            if not len(rows):
                continue  # an iteration after every row had ended (the host learns one step late): not counted
            self.counters["decode_steps"] += 1
            rec = self._rec_host[buf].numpy()[rows]
            n = self.h_n[rows]
            full = n >= self.h_max[rows]
            if full.any():  # the device ran a row past its max_new_tokens: never seen on the CPU; see _desync
                self._desync(rows[full], k)
                rows, rec, n = rows[~full], rec[~full], n[~full]
                if not len(rows):
                    continue
            self.h_tok[rows, n] = rec[:, 0]
            self.h_lp[rows, n] = self._lp_host[buf].numpy()[rows]
            self.h_forced[rows, n] = rec[:, 2].astype(bool)
            self.h_n[rows] = n + 1
            self.h_think[rows] = rec[:, 3]
            self.h_trunc[rows] = rec[:, 4].astype(bool)
            self.counters["generated_tokens"] += len(rows)
            ended = [(int(s), "device") for s in rows[rec[:, 1] == 1]]
            ended += [(int(s), "stop") for s in rows[(rec[:, 1] == 0) & self.h_stop[rows]] if self._hit_stop(int(s))]
            if ended:
                self._finish(ended)
        if drain and self._collected == self._iter:
            # every launch read: a row still running with its record full was not launched again
            # (`_ends_in_flight`), so no later record will show it past its max - it ends here, as `_desync` says
            full = np.flatnonzero(self.h_run & (self.h_n >= self.h_max))
            if len(full):
                self._desync(full, self._iter)

    def _desync(self, slots: np.ndarray, k: int) -> None:
        """Rows whose host record is full (max_new_tokens tokens) while the device reports them still running.
        Seen once, on an H100 with the async pools (a slot thread stepping a compiled engine that shares the
        learner's weights, torch 2.11; 2026-11-27), as an IndexError that failed every running request. The
        rows end here with what they have (finish_reason "length", exactly max_new_tokens tokens), the device
        stops them, and the event is counted (`host_length_ends`) and logged with the state that explains it."""
        st = self.state
        idx = to_device(np.asarray(slots, dtype=np.int64), self.eng.device)
        if not self.counters["host_length_ends"]:
            log.warning(
                "decode bookkeeping out of step at iteration %d (collected %d, launched %d, weight updates %d): slots "
                "%s host tokens %s max_new %s admitted at %s; device n_gen %s max_new %s active %s", k,
                self._collected, self._iter, int(self.counters["weight_updates"]), slots.tolist()[:8],
                self.h_n[slots].tolist()[:8], self.h_max[slots].tolist()[:8], self.h_admit[slots].tolist()[:8],
                st.n_gen[idx].tolist()[:8], st.max_new[idx].tolist()[:8], st.active[idx].tolist()[:8])
        self.counters["host_length_ends"] += len(slots)
        self._finish([(int(s), "length") for s in slots])

    def _hit_stop(self, s: int) -> bool:
        stop = self._slot_seq[s].req.sampling.stop
        if not stop:
            return False
        n = self.h_n[s]
        if self._forcing(s):
            return False
        tail = self.eng.tokenizer.decode(self.h_tok[s, max(0, n - 1 - max(len(x) for x in stop)):n].tolist(),
                                         skip_special_tokens=True)
        return any(x in tail for x in stop)

    def _forcing(self, s: int) -> bool:
        """Is the row inside its forced close sequence, tokens of it still to come (stop strings wait)?"""
        n, c = int(self.h_n[s]), len(self._think.close_seq)
        forced = np.flatnonzero(self.h_forced[s, :n])
        return 0 < len(forced) < c

    # ------------------------------------------------------------------------------------------ finish

    def _finish(self, ended: list[tuple[int, str]]) -> None:
        """Completions of the rows that ended; their slots are freed (or parked for their episode) and the
        device stops them (rows the host ended on a stop string are still running there)."""
        eng = self.eng
        slots = [s for s, _ in ended]
        toks = [self.h_tok[s, : self.h_n[s]].tolist() for s in slots]
        # one batched decode for every ended row (the Craftax rollout: 2,048 rows a step)
        texts = compat.decode_batch(eng.tokenizer, toks, skip_special_tokens=True)
        idx = to_device(np.asarray(slots, dtype=np.int64), eng.device)  # no sync with the step in flight
        # index_fill_, not `active[idx] = False`: indexed assignment of a Python scalar copies the scalar to the
        # device from pageable memory, which synchronises the stream - the host waited for the decode step in
        # flight at every batch of ended rows (torch.profiler, H200, 2026-12-01: one cudaStreamSynchronize of
        # ~2 ms per `_finish`; py-spy: 0.12 s a Craftax rollout step on this line)
        self.state.active.index_fill_(0, idx, False)
        results = []
        slots_out: list[tuple] = []  # (slot, its Seq, tokens, prompt list) to park, or (slot, None, ...) to free
        # the rows with a forced token (a thinking budget's close), found for all at once: most rows have none
        any_forced = self.h_forced[slots].any(axis=1).tolist()
        for (s, how), tokens, text, has_forced in zip(ended, toks, texts, any_forced):
            seq = self._slot_seq[s]
            sp = seq.req.sampling
            n = len(tokens)
            cut = [text.find(x) for x in sp.stop if x and x in text]
            if cut:
                text = text[: min(cut)]
            forced = np.flatnonzero(self.h_forced[s, :n]).tolist() if has_forced else []
            if how == "stop" or (tokens[-1] in eng.eos_ids and (n - 1) not in forced):
                finish = "stop"
            else:
                finish = "length"
            if finish != "length" and self.h_trunc[s]:
                finish = "budget"
            comp = Completion(token_ids=tokens, text=text,
                              logprobs=self.h_lp[s, :n].tolist() if sp.logprobs else None, finish_reason=finish,
                              prompt_token_ids=_prompt_list(seq), thinking_tokens=int(self.h_think[s]),
                              forced_token_indices=forced)
            results.append(GenerationResult(
                handle=seq.handle, completion=comp, tag=seq.req.tag, episode=seq.req.episode,
                weight_versions=list(seq.versions), prefill_tokens=seq.prefill_tokens,
                reused_tokens=seq.reused_tokens, shared_prefix_tokens=seq.offset, kv_fallback=seq.fallback,
                thinking_budget=sp.thinking_budget))
            self.h_run[s] = False
            self._slot_seq[s] = None
            self.guides.close(s)  # structured outputs: the slot may serve an unconstrained request next
            keep = (seq.req.episode is not None and not seq.released and len(seq.versions) == 1
                    and seq.versions[0][1] == self.version)
            slots_out.append((s, seq, tokens, comp.prompt_token_ids) if keep else (s, None, None, None))
        # the slots parked or freed and the results posted under one hold of the lock (not one a row: a Craftax
        # turn's 256 rows end at once)
        with self._cv:
            for s, seq, tokens, prompt_list in slots_out:
                if seq is not None:
                    self.table.park(s, np.concatenate([seq.prompt, np.asarray(tokens[:-1], dtype=np.int64)]),
                                    seq.offset, self.version, prompt_list + tokens[:-1])
                else:
                    self.table.free(s)
            for r in results:
                self._done[r.handle] = r
            self._cv.notify_all()


def _prompt_list(seq: Seq) -> list[int]:
    """The prompt's ids as a list for its completion: the request's own list where it gave one (the rollout's
    prompts are lists it never changes in place; a multi-turn episode's prompt grows to ~1,500 tokens, and
    `ndarray.tolist()` of it for each of 2,048 turns a step was ~0.05-0.1 s of host time in the Craftax rollout),
    else the array's."""
    p = seq.req.prompt
    return p if type(p) is list else seq.prompt.tolist()
