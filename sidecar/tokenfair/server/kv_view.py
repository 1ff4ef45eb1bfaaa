"""The engine's KV cache as the sidecar sees it: blocks booked as the engine books them.

The core's books (``resident_blocks``) reserve each running request's prompt *and* its
``max_tokens`` at dispatch. An engine (vLLM, SGLang) allocates a request's prompt blocks when it
starts the request and its decode blocks one by one as it generates, and a request it has no room
or no slot for waits in the engine's own queue holding nothing. :class:`KvView` models that per
running request, from what the sidecar sees of it:

* a stream that has relayed ``n`` SSE events (one per token an engine decodes; the role and usage
  events add one or two) holds ``ceil((prompt + n) / block)`` blocks, never more than its
  reservation (``modelled``);
* a request with nothing relayed yet holds its prompt's blocks (it is being prefilled), except
  that the ``waiting`` requests the engine last reported hold none: the most recently sent of the
  unstarted ones, as an engine that serves in arrival order holds them;
* a whole (non-streamed) answer shows no decode until it ends: its prompt alone.

Each fresh report of the engine (``used`` blocks, :mod:`tokenfair.server.engine_state`) sets the
core's correction ``used - modelled`` (:meth:`~tokenfair.core.scheduler.Scheduler.
observe_engine_kv`), and two figures follow (docs/fairness.md §5.3):

* **the gates** (admission, dispatch) see ``resident + correction``: the engine's blocks plus every
  running request's remaining growth to its reservation — conservative: decode growth of the
  requests already running is never taken as free, so an admitted request fits when every one
  reaches its ``max_tokens``;
* **the view** (``/status`` ``kv.view_blocks``, ``tokenfair_kv_view_ratio``) is ``modelled +
  correction``, what the engine holds *now*: equal to the engine's report at a report, moved by
  the streams' decoded tokens, the prompts sent and the requests ended since.

Without a fresh report (engine metrics off, stale or missing) the correction is 0: the gates use
the books and the view is the model alone (``kv.source: books``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenfair.core.jobs import JobState
from tokenfair.core.scheduler import Scheduler


class StreamProgress:
    """What the sidecar has relayed of one running request's answer."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events = 0
        """SSE ``data:`` events relayed so far (0: nothing yet, or a whole answer)."""

    def relayed(self, data: bytes) -> None:
        """Count the events in a piece of the stream relayed to the client."""
        self.events += data.count(b"data:")


class KvView:
    """The running requests' stream progress, and the KV blocks it says the engine holds."""

    def __init__(self) -> None:
        self._running: dict[str, StreamProgress] = {}
        """Request id -> its progress, in the order the requests were sent to the engine."""
        self.engine_waiting = 0
        """Requests the engine last reported holding waiting (0 without a fresh report)."""

    def track(self, request_id: str) -> StreamProgress:
        """A request is sent to the engine now; its progress object (the backend counts its
        stream's events on it)."""
        progress = self._running[request_id] = StreamProgress()
        return progress

    def forget(self, request_id: str) -> None:
        """The request ended (its KV is off the books)."""
        self._running.pop(request_id, None)

    @property
    def running(self) -> int:
        return len(self._running)

    def modelled_blocks(self, scheduler: Scheduler) -> int:
        """The blocks the engine holds now by the model (see the module's docstring): each
        dispatched request its prompt and decoded tokens (at most its reservation), none for
        the last :attr:`engine_waiting` unstarted ones; a request the books hold that is not
        tracked here (dispatched this instant, or done and its KV still held) at its
        reservation."""
        waiting = self.engine_waiting
        block = scheduler.policy.kv_block_tokens
        jobs = scheduler.jobs
        held = 0
        unstarted: list[int] = []
        tracked = 0
        for request_id, progress in self._running.items():
            job = jobs.get(request_id)
            if job is None or job.state is JobState.QUEUED:
                continue
            tracked += job.kv_blocks
            prompt = job.request.prefill_tokens
            if progress.events:
                held += min(job.kv_blocks, -(-(prompt + progress.events) // block))
            else:
                unstarted.append(min(job.kv_blocks, -(-prompt // block)))
        if waiting > 0:
            del unstarted[max(0, len(unstarted) - waiting) :]
        # Held by the books but not tracked here: their reservation, as booked.
        untracked = max(0, scheduler.resident_blocks - tracked)
        return held + sum(unstarted) + untracked

    def observe(self, scheduler: Scheduler, used_blocks: int | None, waiting: int) -> None:
        """A fresh report of the engine (``used_blocks`` in use, ``waiting`` requests not
        started), or None: no fresh report. Sets the core's correction."""
        if used_blocks is None:
            self.engine_waiting = 0
            scheduler.observe_engine_kv(None)
            return
        self.engine_waiting = waiting
        scheduler.observe_engine_kv(used_blocks, self.modelled_blocks(scheduler))

    def view_blocks(self, scheduler: Scheduler) -> int:
        """The blocks the engine holds now, as the sidecar sees them: the model corrected by
        the engine's last report (the model alone without one)."""
        return max(0, self.modelled_blocks(scheduler) + scheduler.kv_correction_blocks)


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
