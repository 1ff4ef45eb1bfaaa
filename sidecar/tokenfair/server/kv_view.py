"""The engine's KV cache as the sidecar sees it: blocks booked as the engine books them.

The core's books (``resident_blocks``) reserve each running request's prompt *and* its
``max_tokens`` at dispatch. An engine (vLLM, SGLang) allocates a request's prompt blocks when it
starts the request and its decode blocks one by one as it generates, and a request it has no room
or no slot for waits in the engine's own queue holding nothing. :class:`KvView` models that per
running request, from what the sidecar sees of it:

* a stream that has relayed ``n`` SSE events (one per token an engine decodes; the role and usage
  events add one or two) holds ``ceil((prompt + min(n, max_tokens)) / block)`` blocks;
* a request with nothing relayed yet holds its prompt's blocks (it is being prefilled), except
  that the ``waiting`` requests the engine last reported hold none: the most recently sent of the
  unstarted ones, as an engine that serves in arrival order holds them, and every one sent since
  (it queues behind them) until its first token;
* a whole (non-streamed) answer shows no decode until it ends: its prompt alone.

Each fresh report of the engine (``used`` blocks, :mod:`tokenfair.server.engine_state`) corrects
the model, and two figures follow (docs/fairness.md §5.3):

* **the gates** (admission, dispatch) see ``resident + (used - modelled)``, the model taken at the
  sidecar's prompt estimates and each request at most its reservation (:meth:`~tokenfair.core.
  scheduler.Scheduler.observe_engine_kv`): the engine's blocks plus every running request's
  remaining growth to its reservation — conservative: decode growth of the requests already
  running is never taken as free, so an admitted request fits when every one reaches its
  ``max_tokens``;
* **the view** (``/status`` ``kv.view_blocks``, ``tokenfair_kv_view_ratio``) is what the engine
  holds *now*: ``modelled + (used - modelled)`` with the model's prompts at the engine's own
  count — the sidecar's estimate times :attr:`KvView.prompt_ratio`, learned from the prompt
  usage the engine reports (its tokenizer and chat template; a decayed ratio of sums) — so equal
  to the engine's report at a report, and moved between reports by the streams' decoded tokens,
  the prompts sent and the requests ended.

Without a fresh report (engine metrics off, stale or missing) there is no correction: the gates
use the books and the view is the model alone (``kv.source: books``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenfair.core.jobs import JobState
from tokenfair.core.scheduler import Scheduler


class StreamProgress:
    """What the sidecar has relayed of one running request's answer."""

    __slots__ = ("events", "sequence")

    def __init__(self, sequence: int) -> None:
        self.sequence = sequence
        """The order it was sent to the engine in."""
        self.events = 0
        """SSE ``data:`` events relayed so far (0: nothing yet, or a whole answer)."""

    def relayed(self, data: bytes) -> None:
        """Count the events in a piece of the stream relayed to the client."""
        self.events += data.count(b"data:")


PROMPT_RATIO_BOUNDS: Final = (0.1, 10.0)
"""The engine's prompt count over the sidecar's estimate is learned within these bounds."""
PROMPT_RATIO_DECAY: Final = 0.95
"""Weight of the past in the learned ratio, per request ended (~20 requests' memory)."""


class KvView:
    """The running requests' stream progress, and the KV blocks it says the engine holds."""

    def __init__(self) -> None:
        self._running: dict[str, StreamProgress] = {}
        """Request id -> its progress, in the order the requests were sent to the engine."""
        self.engine_waiting = 0
        """Requests the engine last reported holding waiting (0 without a fresh report)."""
        self._sent = 0
        self._waiting_from: int | None = None
        """The first request (by :attr:`StreamProgress.sequence`) the engine holds waiting: the
        last ``engine_waiting`` unstarted at its last report, and every one sent after them
        (they queue behind them); None: the engine had nobody waiting."""
        self.prompt_ratio = 1.0
        """The engine's prompt tokens per estimated one, learned from the usage the engine
        reports (its tokenizer and chat template against the sidecar's estimate)."""
        self._estimated = 0.0
        self._reported = 0.0
        self._view_correction: int | None = None
        """``used - modelled`` (at the learned prompt ratio) at the engine's last fresh report;
        None without one."""

    def track(self, request_id: str) -> StreamProgress:
        """A request is sent to the engine now; its progress object (the backend counts its
        stream's events on it)."""
        progress = self._running[request_id] = StreamProgress(self._sent)
        self._sent += 1
        return progress

    def forget(
        self, request_id: str, estimated_prompt: int = 0, reported_prompt: int | None = None
    ) -> None:
        """The request ended; with the engine's prompt count of it (``reported_prompt``) and
        the sidecar's estimate, the prompt ratio learns (decayed sums, bounded)."""
        self._running.pop(request_id, None)
        if reported_prompt is None or reported_prompt <= 0 or estimated_prompt <= 0:
            return
        self._estimated = PROMPT_RATIO_DECAY * self._estimated + estimated_prompt
        self._reported = PROMPT_RATIO_DECAY * self._reported + reported_prompt
        low, high = PROMPT_RATIO_BOUNDS
        self.prompt_ratio = min(high, max(low, self._reported / self._estimated))

    @property
    def running(self) -> int:
        return len(self._running)

    def modelled_blocks(self, scheduler: Scheduler, prompt_ratio: float = 1.0) -> int:
        """The blocks the engine holds now by the model (see the module's docstring): each
        dispatched request its prompt (the estimate times ``prompt_ratio``) and decoded tokens
        (at most its ``max_tokens``); none for an unstarted one the engine holds waiting (the
        last :attr:`engine_waiting` unstarted at its report, and those sent since);
        a request the books hold that is not tracked here (dispatched this instant, or done
        and its KV still held) at its reservation. At ratio 1 (the gates' model) no request
        holds more than its reservation."""
        waiting_from = self._waiting_from
        block = scheduler.policy.kv_block_tokens
        jobs = scheduler.jobs
        held = 0
        tracked = 0
        for request_id, progress in self._running.items():
            job = jobs.get(request_id)
            if job is None or job.state is JobState.QUEUED:
                continue
            tracked += job.kv_blocks
            request = job.request
            prompt = request.prefill_tokens
            if prompt_ratio != 1.0:
                prompt = math.ceil(prompt * prompt_ratio)
            if progress.events:
                tokens = prompt + min(progress.events, request.decode_tokens)
                blocks = -(-tokens // block)
                held += blocks if prompt_ratio != 1.0 else min(job.kv_blocks, blocks)
            elif waiting_from is None or progress.sequence < waiting_from:
                blocks = -(-prompt // block)
                held += blocks if prompt_ratio != 1.0 else min(job.kv_blocks, blocks)
        # Held by the books but not tracked here: their reservation, as booked.
        untracked = max(0, scheduler.resident_blocks - tracked)
        return held + untracked

    def observe(self, scheduler: Scheduler, used_blocks: int | None, waiting: int) -> None:
        """A fresh report of the engine (``used_blocks`` in use, ``waiting`` requests not
        started), or None: no fresh report. Sets the core's correction (the gates' model: the
        estimates as booked) and the view's (the model at the learned prompt ratio)."""
        if used_blocks is None:
            self.engine_waiting = 0
            self._waiting_from = None
            self._view_correction = None
            scheduler.observe_engine_kv(None)
            return
        self.engine_waiting = waiting
        self._waiting_from = None
        if waiting > 0:
            unstarted = [p.sequence for p in self._running.values() if not p.events]
            # Fewer of ours unstarted than it holds waiting: others' requests wait too, and
            # ours sent from now on queue behind them.
            self._waiting_from = unstarted[-waiting] if len(unstarted) >= waiting else self._sent

        scheduler.observe_engine_kv(used_blocks, self.modelled_blocks(scheduler))
        self._view_correction = used_blocks - self.modelled_blocks(scheduler, self.prompt_ratio)

    def view_blocks(self, scheduler: Scheduler) -> int:
        """The blocks the engine holds now, as the sidecar sees them: the model (at the
        learned prompt ratio) corrected by the engine's last report (the model alone without
        one)."""
        modelled = self.modelled_blocks(scheduler, self.prompt_ratio)
        return max(0, modelled + (self._view_correction or 0))


class KvViewCollector(Collector):
    """``tokenfair_kv_view_ratio``: the engine's KV cache in use as the sidecar sees it now."""

    def __init__(self, view: KvView, scheduler: Callable[[], Scheduler]) -> None:
        self._view = view
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        scheduler = self._scheduler()
        yield GaugeMetricFamily(
            "tokenfair_kv_view_ratio",
            "KV blocks the engine holds now as the sidecar sees them (the running requests' "
            "prompts and decoded tokens, corrected by the engine's last report) over total KV "
            "blocks.",
            self._view.view_blocks(scheduler) / scheduler.policy.total_kv_blocks,
        )
