"""The worker-side hook: what vLLM's model runner knows, handed to the SeKV runtime.

Around each `execute_model` of a runner whose config carries `sekv`:
  before: release finished and preempted requests (both tiers), admit new ones; compress every
          request whose prompt was completed by the step before: the surprisal of that step's
          prompt tokens, then the method's compression; its prompt pages are then handed back to
          vLLM's pool (kv_pages.py) but for the fast tier's share. Done here, not right after the
          prompt's last forward pass, the first token is sampled and sent with the prompt's rows
          still exact: compression is not part of the time to first token.
  after:  surprisal of the prompt tokens prefilled this step, from the model's own logits
          over them (s_t = -log p(x_t | x_<t)), but for a chunk that completes its prompt: its
          hidden rows are kept for the next step's compression. With `window_growth`, the surprisal of
          compressed requests' output tokens too (from the logits this step computed for
          sampling, resolved once the sampled token is known, at the next step), and the
          spanification of every window that outgrew it, whose pages go back the same way.
          Then every compressed request's full-resolution rows move into the pages it keeps
          (vLLM's KV cache of each layer, reinterpreted as [pages, 2, block, Hkv, D]); the metadata
          builder hands it each page vLLM allocates later (`sync_pages`).

An exception in sekv's work for one request (admission, surprisal, compression, spanification,
placement) is that request's alone: a request whose pages are all still in vLLM's pool goes on at
full KV (logged); a compressed one, whose pages went back, is failed (request_failures.py: HTTP 500
naming the cause); its sekv state is freed either way, and the other requests go on.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from sekv_vllm.config import SeKVConfig
from sekv_vllm.core.surprisal import LogitHead, bfloat16_is_fast, token_surprisal
from sekv_vllm.integration.vllm import request_failures
from sekv_vllm.integration.vllm.page_plans import PagePlans
from sekv_vllm.integration.vllm.version import RunnerView, StepSchedule, kv_pages
from sekv_vllm.router import ModelShape
from sekv_vllm.runtime import SeKVRuntime, Status

logger = logging.getLogger("sekv_vllm")

_current: "RunnerBridge | None" = None
# Rows of logits computed at once for surprisal: bounds the [rows, vocab] float32 buffer.
_LOGIT_CHUNK = 256
# `_placed` of a request whose rows did not fit its kept pages (logged once; tried again after a spanification).
_DID_NOT_FIT = -1
# Failed steps in a row after which the engine is taken to be broken, not one request: the step guard re-raises.
MAX_FAILED_STEPS = 3


@dataclass(frozen=True)
class DueCompression:
    """A request whose prompt the last step completed, compressed at the start of the next.

    prompt: its prompt's token ids
    hidden: [n, hidden_size] the last hidden states of that step's prompt tokens that predict a
            prompt token (positions start .. start + n - 1); None when its method reads no surprisal
    """

    prompt: list[int]
    hidden: torch.Tensor | None
    start: int


def current_bridge() -> "RunnerBridge | None":
    """The bridge of the runner executing the current step in this process."""
    return _current


class RunnerBridge:
    def __init__(self, runner: RunnerView, config: SeKVConfig) -> None:
        self.runner = runner
        self.layers = runner.attention_layers()
        first = next(iter(self.layers.values()))
        shape = ModelShape(len(self.layers), first.num_heads, first.num_kv_heads, first.head_size)
        self.runtime = SeKVRuntime(config, list(self.layers), shape, runner.model_name)
        kv_pages.on_request_freed(self._on_pages_freed)
        self._page_plans = PagePlans()
        # Per compressed request: (position, logits [vocab] float32) of the token the last step's logits
        # predict; its surprisal is known once that token is sampled.
        self._pending_logits: dict[str, tuple[int, torch.Tensor]] = {}
        # Requests whose prompt the last step completed: compressed at the start of the next step.
        self._due: dict[str, DueCompression] = {}
        # Compressed requests whose rows were put in vLLM's pages: how many of their block ids were handed over.
        self._placed: dict[str, int] = {}
        self._kv_pages: dict[str, torch.Tensor] | None = None
        # Evidence of continuous batching: steps where a prefill chunk ran beside compressed decodes.
        self.steps_mixing_prefill_and_compressed_decode = 0
        # Requests that keep full KV after sekv's work for them failed (never admitted again).
        self._full_kv_after_error: set[str] = set()
        self._failed_steps_in_a_row = 0
        # The output projection the prompt-token surprisal is computed with (built at the first prompt, once
        # the weights are loaded); None: the model's own logits.
        self._logit_head: LogitHead | None = None
        self._logit_head_chosen = False

    # -- step hooks ----------------------------------------------------------------------
    def before_step(self, step: StepSchedule) -> None:
        global _current
        _current = self
        for req_id in step.finished:
            self.runtime.release(req_id, outcome="finished")
        for req_id in step.preempted:
            self._on_pages_freed(req_id, preempted=True)
        for new in step.new:
            with self._request_work(new.req_id, "admission"):
                if self.runtime.get(new.req_id) is not None:  # resumed: start again from its prompt
                    self.runtime.release(new.req_id, outcome="restarted")
                self._admit(new.req_id, new.prompt_len, new.extra_args)
        # A preempted request comes back as a cached one and recomputes its prompt and output.
        # Compressed before: its kept state serves it again (the metadata builder answers only
        # the recompute's newest row) and its prompt pages go back once more. Else it is
        # admitted again and compressed when its prompt is complete.
        for req_id in step.resumed:
            with self._request_work(req_id, "resumption"):
                self._resume(req_id)
        due, self._due = self._due, {}
        for req_id, work in due.items():
            mem = self.runtime.get(req_id)
            if mem is None or mem.status is not Status.PREFILLING:
                continue  # finished, preempted or failed since
            with self._request_work(req_id, "compression"):
                if work.hidden is not None:
                    self._record_surprisal(req_id, work.prompt, work.hidden, 0, work.start, work.hidden.shape[0])
                self._compress(req_id)

    def _resume(self, req_id: str) -> None:
        mem = self.runtime.get(req_id)
        if mem is not None and mem.suspended:
            self.runtime.resume(req_id)
            self._page_plans.refile(req_id)
            return
        if not self.runner.knows(req_id):
            return
        if mem is not None:
            self.runtime.release(req_id, outcome="restarted")
        self._admit(req_id, len(self.runner.prompt(req_id)), self.runner.extra_args(req_id))

    def _admit(self, req_id: str, prompt_len: int, extra: dict | None) -> None:
        if req_id not in self._full_kv_after_error:
            self.runtime.admit(req_id, prompt_len, extra)

    def after_step(self, step: StepSchedule) -> None:
        outputs = self.runner.step_outputs()
        if outputs is None:
            return
        for i, req_id in enumerate(self.runner.batch_req_ids()):
            mem = self.runtime.get(req_id)
            if mem is None or mem.status is not Status.PREFILLING:
                continue
            start = self.runner.computed_tokens(req_id)  # before this step
            n = step.num_tokens.get(req_id, 0)
            with self._request_work(req_id, "compression"):
                row0 = int(outputs.query_start[i])
                prompt = self.runner.prompt(req_id)
                if start + n < mem.prompt_len:
                    if self.runtime.needs_surprisal(req_id):
                        self._record_surprisal(req_id, prompt, outputs.hidden, row0, start, n)
                    continue
                predicting = max(min(start + n, len(prompt) - 1) - start, 0)  # rows that predict a prompt token
                hidden = (outputs.hidden[row0 : row0 + predicting].clone()  # the buffer is reused next step
                          if self.runtime.needs_surprisal(req_id) else None)
                self._due[req_id] = DueCompression(prompt, hidden, start)
        if self.runtime.config.window_growth:
            self._record_output_surprisal(step, outputs.logits)
            for req_id in list(self.runtime.requests):
                with self._request_work(req_id, "output spanification"):
                    if self.runtime.window_due(req_id):
                        self._spanify(req_id)
        for req_id in self.runner.batch_req_ids():
            mem = self.runtime.get(req_id)
            if (mem is None or mem.status is not Status.COMPRESSED or mem.suspended
                    or self.runtime.rows_in_engine_pages(req_id) or self._placed.get(req_id) == _DID_NOT_FIT
                    or self.runner.computed_tokens(req_id) + step.num_tokens.get(req_id, 0) < mem.next_position):
                continue  # not compressed, placed (or tried), or not computed up to its newest row (a recompute)
            with self._request_work(req_id, "row placement"):
                self._place_rows(req_id)

    # -- failures ------------------------------------------------------------------------------
    @contextmanager
    def _request_work(self, req_id: str, what: str) -> Iterator[None]:
        """sekv's work for one request: an exception in it is that request's alone."""
        try:
            yield
        except Exception as err:
            self.request_failed(req_id, what, err)

    def request_failed(self, req_id: str, what: str, err: Exception) -> None:
        """Free the request's sekv state; it goes on at full KV while all its pages are still in vLLM's
        pool (not compressed yet), else it is failed with the cause."""
        cause = f"{what} failed: {type(err).__name__}: {err}"
        compressed = self.runtime.is_compressed(req_id) or req_id in self._page_plans
        self.drop(req_id)
        if compressed:
            logger.exception("sekv: request %s: %s; its pages went back to the pool, so it fails", req_id, cause)
            request_failures.fail(req_id, cause)
        else:
            logger.exception("sekv: request %s: %s; it keeps full KV", req_id, cause)
            self._full_kv_after_error.add(req_id)

    def drop(self, req_id: str, outcome: str = "failed") -> None:
        """Free everything sekv holds for a request (both tiers, page plans), whatever its state."""
        self._page_plans.forget(req_id)
        self._pending_logits.pop(req_id, None)
        self._due.pop(req_id, None)
        self._placed.pop(req_id, None)
        self.runtime.release(req_id, outcome=outcome)

    def step_failed(self) -> bool:
        """Count a step that raised; False once `MAX_FAILED_STEPS` failed in a row (the engine is broken)."""
        self._failed_steps_in_a_row += 1
        return self._failed_steps_in_a_row < MAX_FAILED_STEPS

    def step_succeeded(self) -> None:
        self._failed_steps_in_a_row = 0

    # -- batch facts for the metadata builder ----------------------------------------------
    def batch_req_ids(self, num_reqs: int) -> list[str]:
        return self.runner.batch_req_ids()[:num_reqs]

    def sync_pages(self, req_id: str) -> bool:
        """Hand a compressed request's pages allocated since it was placed to its rows; False if that
        failed (the request has failed then)."""
        have = self._placed.get(req_id)
        if have is None or have == _DID_NOT_FIT or not self.runtime.rows_in_engine_pages(req_id):
            return True
        block_ids = self.runner.block_ids(req_id)
        if len(block_ids) > have:
            with self._request_work(req_id, "page hand-over"):
                self.runtime.add_pages(req_id, torch.tensor(block_ids[have:], dtype=torch.int64))
                self._placed[req_id] = len(block_ids)
        return self.runtime.is_compressed(req_id)

    def has_active(self) -> bool:
        """Whether any request of this worker needs SeKV (prefilling or compressed)."""
        return any(self.runtime.is_active(r) for r in self.runtime.requests)

    # -- internals ---------------------------------------------------------------------------
    def _on_pages_freed(self, req_id: str, preempted: bool) -> None:
        if not preempted:
            self._full_kv_after_error.discard(req_id)
        mem = self.runtime.get(req_id)
        if mem is None:
            return
        if preempted and mem.status is Status.COMPRESSED:
            self._placed.pop(req_id, None)  # its rows are copied out of the pages freed now
            self.runtime.suspend(req_id)
        else:
            self.drop(req_id, outcome="preempted" if preempted else "ended")

    def _record_output_surprisal(self, step: StepSchedule, logits: torch.Tensor | None) -> None:
        """Surprisal of compressed requests' output tokens: the token predicted by the previous step's
        logits is sampled by now; this step's logits (one row per request, batch order) predict the next."""
        req_ids = self.runner.batch_req_ids()
        growth = self.runtime.config.window_growth
        one_row_each = logits is not None and logits.shape[0] == len(req_ids)
        rows, pending = [], []
        for i, req_id in enumerate(req_ids):
            # a window grows by at most max_tokens - 1 rows: no more than `growth`, never spanified
            if (not (self.runtime.is_compressed(req_id) or req_id in self._due) or not self.runtime.needs_surprisal(req_id)
                    or not self.runner.knows(req_id) or (self.runner.max_tokens(req_id) or growth + 1) <= growth):
                continue
            before = self._pending_logits.pop(req_id, None)
            if before is not None:
                position, row = before
                output = self.runner.output(req_id)
                j = position - len(self.runner.prompt(req_id))
                if 0 <= j < len(output) and output[j] >= 0:
                    value = token_surprisal(row[None], torch.tensor([output[j]]))
                    self.runtime.record_surprisal(req_id, torch.tensor([position]), value)
            if one_row_each:
                rows.append(i)
                pending.append((req_id, self.runner.computed_tokens(req_id) + step.num_tokens.get(req_id, 0)))
        if rows:
            picked = logits[rows].float()  # a copy: the sampler may change the logits in place
            for k, (req_id, position) in enumerate(pending):
                self._pending_logits[req_id] = (position, picked[k])

    def _spanify(self, req_id: str) -> None:
        """Spanify the request's window; the pages wholly inside the compressed rows go back (`PagePlans`)."""
        part = self.runtime.spanify_window(req_id)
        if part is not None:
            self._placed.pop(req_id, None)  # its rows, rewritten, are in sekv's own pages until placed again
            pages = self._page_plans.after_spanification(self.runtime.get(req_id), part, *self._block_size_and_bytes())
            if pages is not None:
                self.runtime.record_engine_pages(req_id, pages)

    def _place_rows(self, req_id: str) -> None:
        """Move a compressed request's rows into the pages it keeps: every page of its block table but
        those its page ranges return (still listed until the manager frees them), in order."""
        block_ids = self.runner.block_ids(req_id)
        kept = self._page_plans.kept(req_id, block_ids, self.runner.block_size)
        placed = self.runtime.place_rows(req_id, self._engine_pages(), torch.tensor(kept, dtype=torch.int64))
        self._placed[req_id] = len(block_ids) if placed else _DID_NOT_FIT

    def _engine_pages(self) -> dict[str, torch.Tensor]:
        """Each layer's KV cache as pages of rows [num_blocks, 2, block, Hkv, D] (the same memory): a page sekv
        keeps is never read by vLLM's kernel."""
        if self._kv_pages is None:
            self._kv_pages = {name: self.runner.kv_pages(layer) for name, layer in self.layers.items()}
        return self._kv_pages

    def _block_size_and_bytes(self) -> tuple[int, int]:
        """vLLM's page size in tokens, and the bytes of one page across every layer."""
        return self.runner.block_size, self.runner.page_bytes(next(iter(self.layers.values()))) * len(self.layers)

    def _record_surprisal(
        self, req_id: str, prompt: list[int], hidden: torch.Tensor, row0: int, start: int, n: int
    ) -> None:
        """hidden[row0 + j] is position start + j and predicts prompt token start + j + 1."""
        T = len(prompt)
        stop = min(start + n, T - 1)
        if stop <= start:
            return
        targets = torch.tensor(prompt[start + 1 : stop + 1], dtype=torch.int64)
        head = self._surprisal_head(hidden)
        buffer = head.logit_buffer(min(_LOGIT_CHUNK, stop - start)) if head is not None else None
        values = []
        for a in range(0, stop - start, _LOGIT_CHUNK):
            b = min(a + _LOGIT_CHUNK, stop - start)
            rows = hidden[row0 + a : row0 + b]
            values.append(head.surprisal(rows, targets[a:b], buffer) if head is not None
                          else token_surprisal(self.runner.compute_logits(rows), targets[a:b]))
        self.runtime.record_surprisal(req_id, torch.arange(start + 1, stop + 1), torch.cat(values))

    @property
    def surprisal_source(self) -> str | None:
        """Where the prompt-token surprisal comes from: "model" (its own logits), else the dtype of the output
        projection's copy ("bfloat16", "float32"), followed by ", tail sampled" under `surprisal_exact_tokens`;
        None before the first prompt."""
        if not self._logit_head_chosen:
            return None
        head = self._logit_head
        if head is None:
            return "model"
        return str(head.weight.dtype).removeprefix("torch.") + (", tail sampled" if head.sampled else "")

    def _surprisal_head(self, hidden: torch.Tensor) -> LogitHead | None:
        """`surprisal_precision`'s projection (a bfloat16 copy of the model's) with `surprisal_exact_tokens`'
        sampled tail, or None (the model's own logits)."""
        if not self._logit_head_chosen:
            self._logit_head_chosen = True
            cfg = self.runtime.config
            precision = cfg.surprisal_precision
            if precision == "auto":
                precision = "bfloat16" if bfloat16_is_fast(hidden.device) else "model"
            dtype = torch.bfloat16 if precision == "bfloat16" else hidden.dtype
            if dtype != hidden.dtype or cfg.surprisal_exact_tokens:
                self._logit_head = self.runner.logit_head(dtype)
                if self._logit_head is None:
                    logger.warning("sekv: surprisal_precision %r, surprisal_exact_tokens %d: the model's output "
                                   "projection is not a plain matrix; the surprisal comes from its own logits",
                                   cfg.surprisal_precision, cfg.surprisal_exact_tokens)
                elif cfg.surprisal_exact_tokens:
                    self._logit_head = replace(self._logit_head, exact_tokens=cfg.surprisal_exact_tokens)
            logger.info("sekv: prompt-token surprisal from %s%s", "the model's own logits" if self._logit_head is None
                        else f"a {str(dtype).removeprefix('torch.')} copy of the output projection",
                        f", the log-sum-exp's tail sampled past token id {cfg.surprisal_exact_tokens}"
                        if self._logit_head is not None and self._logit_head.sampled else "")
        return self._logit_head

    def _compress(self, req_id: str) -> None:
        mem = self.runtime.compress(req_id)
        if mem.status is Status.COMPRESSED:
            pages = self._page_plans.after_compression(mem, *self._block_size_and_bytes(), self.runtime.config.return_pages)
            self.runtime.record_engine_pages(req_id, pages)


def figures_by_request_id() -> dict[str, dict]:
    """`request_figures()` keyed by the request id `LLM.generate` reports (the engine appends
    a suffix of its own to each id)."""
    return {f["req_id"].rsplit("-", 1)[0]: f for f in request_figures()}


def request_figures() -> list[dict]:
    """Figures of every compressed request this process has seen (in-process engines only)."""
    bridge = current_bridge()
    if bridge is None:
        return []
    live = [bridge.runtime.figures(r) for r in bridge.runtime.requests]
    return list(bridge.runtime.completed_figures) + [f for f in live if f]
