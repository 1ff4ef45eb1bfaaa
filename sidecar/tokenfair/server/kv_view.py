"""The engine's KV cache as the sidecar sees it: blocks booked as the engine books them.

The core's books (``resident_blocks``) reserve each running request's prompt *and* its
``max_tokens`` at dispatch. An engine (vLLM, SGLang) allocates a request's prompt blocks when it
starts the request and its decode blocks one by one as it generates, and a request it has no room
or no slot for waits in the engine's own queue holding nothing. :class:`KvView` models that per
running request, from what the sidecar sees of it:

* a stream that has relayed ``n`` SSE events (one per token an engine decodes; the role and usage
  events add one or two) holds ``ceil((prompt + min(n, max_tokens)) / block)`` blocks;
* a stream with nothing relayed yet may be waiting in the engine's queue, on its way to the
  engine, or being prefilled: it holds its prompt if the engine's last report ran it (the
  engine's running count less ours that have streamed: the oldest unstarted), or the last
  report had nobody waiting and the stream has been on its way longer than the engine's
  *intake delay* (:attr:`KvView.intake_ms`, learned from the reports: the engine's count of
  running and waiting requests says which of ours it has not received yet), else nothing;
* a whole (non-streamed) answer shows no progress: its prompt, until it ends.

Each fresh report of the engine (``used`` blocks, running and waiting requests:
:mod:`tokenfair.server.engine_state`) corrects the model, and two figures follow
(docs/fairness.md §5.3):

* **the gates** (admission, dispatch) see ``resident + (used - held)`` (:meth:`~tokenfair.core.
  scheduler.Scheduler.observe_engine_kv`), ``held`` being what the engine surely holds for the
  running requests — a stream that has shown tokens its booked prompt and the tokens relayed,
  at most its reservation; nothing for one that has not (a prompt the engine may not hold yet is
  never taken as held): the engine's blocks plus every running request's remaining growth to
  its reservation. Under preemption (the report runs fewer than have started here) the
  most recently sent streams that have shown tokens, as many as the difference, hold nothing
  (the engine freed their blocks, newest first); and ``held`` is at most ``used``.
  Conservative: decode growth of the requests already running is never taken as free, nor are
  a preempted request's freed blocks, so an admitted request fits when every one reaches its
  ``max_tokens``;
* **the view** (``/status`` ``kv.view_blocks``, ``tokenfair_kv_view_ratio``) is what the engine
  holds *now*: the model with the prompts at the engine's own count — the sidecar's estimate
  times :attr:`KvView.prompt_ratio`, learned from the prompt usage the engine reports (its
  tokenizer and chat template; a decayed ratio of sums) — plus ``used - modelled`` at the last
  report: the engine's figure at a report, moved between reports by the streams' tokens, the
  requests ended and the whole answers sent.

Without a fresh report (engine metrics off, stale or missing) there is no correction: the gates
use the books and the view is the model alone (``kv.source: books``).

**Decode booked as the engine books it** (``kvDecodeBooking: engine``; ``upfront``, the
default, is the above): while a report is fresh, the gates count a running stream's decode only
as far as the engine will have allocated it by the next report, not to its ``max_tokens``::

    gate = used + sum over running streams (soon - held)   (whole answers: reservation - held)
    soon = min(reservation, ceil((prompt + shown + allowance) / block))
    allowance = max(block, ceil(rate * 2 * gap))

``shown``: the tokens relayed; ``rate``: the fastest stream's tokens per ms between the last two
fresh reports, ``gap`` the time between them (:meth:`KvView._decode_allowance`): every stream
decoding no faster than the fastest seen stays within its booking for two report intervals
(one report late), and the next token of a stream at a block's end has its block. A request
dispatched before the next report is booked at ``min(reservation, ceil((prompt + allowance) /
block))`` (``Scheduler.kv_gate_job_blocks``). The books, the tenants' ``maxKvShare``, service
tokens and records are unchanged. The trade-off: decode the gates did not count grows into the
watermark's headroom (``1 - kvWatermark`` of the cache); past the cache the engine preempts
(vLLM: frees a running request's blocks and recomputes it later). Stale or missing reports:
the gates book up front again at once.

**Decode booked to the forecast peak** (``kvDecodeBooking: peak``): while a report is fresh,
the gates count the running streams' decode only to the most their blocks will reach together,
forecast at one common decode rate (docs/fairness.md §5.3)::

    gate = used + growth(t*) + (what the streams forecast to end before t* hold)
    growth(t) = sum over streams running at t (b(t) - held) - sum over those ended by t (held)

``t`` runs over the streams' ends in the order of their decode to come (``max_tokens -
shown``), ``b(t)`` is a stream's blocks after ``t`` more tokens, ``t*`` the first end at the
maximum (:func:`peak_credits`). Requests at the same progress (a burst dispatched together)
count the sum of their reservations, as ``upfront``; staggered ones less: booking decode up
front costs a lane of long prompts a request of concurrency whenever its requests are
staggered. A stream not yet past its first token, a whole answer, a preempted stream and a
stream whose end is not bounded by its own ``max_tokens`` for one sequence of one prompt
(:attr:`StreamProgress.bounded_end`: ``n`` above 1 or a batch of prompts decode several
tokens a step; without ``max_tokens`` the engine may decode past the estimate) keep their
reservations and offset nobody's growth; above :data:`PEAK_FORECAST_MAX_STREAMS` streams to
forecast the report books all up front; a request dispatched before the next report is
booked at its reservation (no allowance, ``Scheduler.kv_gate_job_blocks`` unchanged). Each
credit is given back at its request's end; stale or missing reports: up front at once. Streams
faster than others (the common rate is an assumption: chunked prefill, priorities or
speculative decoding break it) are the watermark's headroom's to absorb, and so is a stream's
growth past the forecast peak once a stream forecast to end later ended first (a stop token):
its credit leaves with it, the others' growth is counted again at the next report.

**The prompt ratio in the books** (``kvPromptRatio: learned``, the default): the gates book a
request admitted now at the engine's prompt count too — its estimated prompt times the learned
ratio, within :data:`GATE_PROMPT_RATIO_BOUNDS`
(:attr:`~tokenfair.core.scheduler.Scheduler.kv_prompt_ratio`, ``Job.kv_prompt_tokens``), and a
stream that has shown tokens holds that booked prompt. A request the engine has not reported
yet (on its way to it, in its queue) is counted at what it will allocate, not at the estimate:
with prompts 2x the estimate, a burst dispatched between two reports no longer fills the cache
past the watermark on the books' word. ``off``: the estimate (the view still learns). Service
tokens, budgets and the records' fields stay the estimate's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenfair.core.scheduler import Scheduler


class StreamProgress:
    """What the sidecar has relayed of one running request's answer."""

    __slots__ = (
        "bounded_end",
        "done",
        "events",
        "events_at_report",
        "sent_ms",
        "sequence",
        "stream",
    )

    def __init__(
        self, sequence: int, stream: bool, sent_ms: float = 0.0, bounded_end: bool = False
    ) -> None:
        self.sequence = sequence
        """The order it was sent to the engine in."""
        self.bounded_end = bounded_end
        """Its end is known: one sequence of one prompt, bounded by the request's own
        ``max_tokens`` (or ``max_completion_tokens``), so it decodes one token per engine step
        and ends by that bound (the peak forecast takes only such streams)."""
        self.sent_ms = sent_ms
        """When it was sent (the view's clock; 0 without one)."""
        self.stream = stream
        """A streamed answer (its progress shows); False: a whole answer (it shows none)."""
        self.events = 0
        """SSE ``data:`` events relayed so far (0: nothing yet, or a whole answer)."""
        self.done = False
        """Its ``data: [DONE]`` was relayed: the engine has finished it (the request is
        forgotten once the sidecar has closed it)."""
        self.events_at_report = -1
        """:attr:`events` at the engine's last fresh report (-1: none since it was sent): the
        decode rate's evidence (``kvDecodeBooking: engine``)."""

    def relayed(self, data: bytes) -> None:
        """Count the events in a piece of the stream relayed to the client."""
        self.events += data.count(b"data:")
        if b"[DONE]" in data:
            self.done = True


PROMPT_RATIO_BOUNDS: Final = (0.1, 10.0)
"""The engine's prompt count over the sidecar's estimate is learned within these bounds."""
PROMPT_RATIO_DECAY: Final = 0.95
"""Weight of the past in the learned ratio, per request ended (~20 requests' memory)."""
INTAKE_MAX_MS: Final = 5000.0
"""The longest intake delay the view learns (a request on its way to the engine that long is
an engine in trouble, not its intake)."""
INTAKE_DOWN: Final = 0.2
"""How far the intake delay moves toward a shorter delay the engine's report shows, per
report. A longer one is taken at once, but only from the report's own evidence: a stream
unstarted at a report counts once its age passes the delay so learned, even before the next
report says whether the engine has it."""
GATE_PROMPT_RATIO_BOUNDS: Final = (0.5, 4.0)
"""The learned ratio the KV gates book prompts at, at most this far from the estimate: a
tokenizer and chat template move a prompt's count by ~2x (loadgen's text on the suite's model:
2.0); a ratio past these is more likely an estimator gone wrong, which the engine's reports
(the gates' correction) cover as before."""


KV_DECODE_BOOKING_MODES: Final = ("upfront", "engine", "peak")
"""The sidecar's ``kvDecodeBooking`` settings (:attr:`KvView.decode_booking`)."""
PEAK_FORECAST_MAX_STREAMS: Final = 256
"""``kvDecodeBooking: peak`` forecasts the peak of at most this many streams (those it would
forecast: bounded, past their first token, not preempted): its cost is ``O(r^2)`` per fresh
report on the event loop (~5 ms at 256 streams, ~70 ms at 1,024, interpreted), so above it a
report books every running request up front, as ``upfront`` does."""
PEAK_EVENTS_NOT_TOKENS: Final = 2
"""Events a stream relays beside its tokens (the role event of a chat, the usage event): the
peak forecast takes a stream's decode to come as ``max_tokens - shown`` plus this many, so
those two never make it forecast an end before the last token (a token whose text holds
``data:`` still counts more than once: :meth:`StreamProgress.relayed` counts every
``data:``)."""
DECODE_HORIZON_REPORTS: Final = 2.0
"""``kvDecodeBooking: engine`` books each running stream's decode for this many of the
engine's report intervals at the fastest decode rate seen (one report late is covered)."""


def peak_credits(streams: list[tuple[int, int, int, int, str]], block: int) -> dict[str, int]:
    """``kvDecodeBooking: peak``: each running stream's gate credit against the forecast peak
    of their blocks. A stream is ``(left, tokens, reserved, held, request_id)``: its decode
    tokens to come (``max_tokens - shown``), the tokens it holds blocks for (its booked prompt
    and ``shown``), its reservation and the blocks it surely holds (both in blocks).

    All decode at one common rate (tokens per stream per step), so stream ``i`` ends after
    ``left_i`` tokens, holding ``b_i(t) = min(reserved_i, ceil((tokens_i + t) / block))``
    blocks until then; the peak does not depend on the rate. The net growth of their blocks::

        growth(t) = sum over i with left_i >= t of (b_i(t) - held_i)
                  - sum over i with left_i <  t of held_i        (ended: their blocks freed)

    is evaluated just before each end (``t`` = each ``left``; its maximum is at one of them,
    or 0 now) and ``t*`` is the first ``t`` at its maximum. Credits: a stream running at
    ``t*`` ``reserved - b_i(t*)``; one that ends before ``t*`` ``reserved - held``. The gates
    then count::

        gate = used + sum over i with left_i >= t* of (b_i(t*) - held_i)
             = used + growth(t*) + sum over i with left_i < t* of held_i

    that is, the forecast peak, plus, where the peak comes after some ends (long decodes
    beside short ones), the blocks of the streams forecast to end before it: those are never
    credited, so every credit is at most its own request's growth to come and the gates never
    see fewer blocks than the engine's report less what the requests ended since held in it,
    whatever order they end in (a credit is given back at its request's end; once the streams
    forecast to end first have ended, the gates count the peak exactly). The sum of the
    reservations when all are at the same progress; less the more they are staggered; never
    more than ``upfront``.

    Cost: ``O(r^2)`` for ``r`` streams, once per fresh report."""
    streams = sorted(streams)  # by decode to come: the order they end in
    best = 0  # growth(0): every stream at what it holds
    best_at = -1
    for at, _, _, _, _ in streams:
        growth = 0
        for left, tokens, reserved, held, _ in streams:
            if left >= at:
                blocks = -(-(tokens + at) // block)
                growth += (reserved if blocks > reserved else blocks) - held
            else:
                growth -= held
        if growth > best:
            best = growth
            best_at = at
    credits: dict[str, int] = {}
    for left, tokens, reserved, held, request_id in streams:
        if best_at >= 0 and left >= best_at:
            blocks = -(-(tokens + best_at) // block)
            credit = reserved - max(held, min(reserved, blocks))
        else:
            credit = reserved - held
        if credit > 0:
            credits[request_id] = credit
    return credits


class KvView:
    """The running requests' stream progress, and the KV blocks it says the engine holds."""

    def __init__(
        self,
        follows_streams: bool = True,
        books_prompt_ratio: bool = True,
        clock: Callable[[], float] | None = None,
        decode_booking: str = "upfront",
        stale_after_ms: float = 0.0,
    ) -> None:
        if decode_booking not in KV_DECODE_BOOKING_MODES:
            raise ValueError(
                f"KvView.decode_booking: must be one of {', '.join(KV_DECODE_BOOKING_MODES)} "
                f"(got {decode_booking!r})"
            )
        self.decode_booking = decode_booking if follows_streams else "upfront"
        """``upfront``: the gates book every running request's decode to its ``max_tokens``
        (the default); ``engine``: while the engine's report is fresh, its prompt, the tokens
        relayed and :attr:`decode_allowance_tokens`; ``peak``: while it is fresh, the running
        streams' decode to the forecast peak of their blocks (:meth:`peak_credits`; the
        module's docstring)."""
        self.decode_allowance_tokens = -1
        """The decode tokens the gates booked each running stream beyond what it has shown
        at the last fresh report (``engine`` mode; -1: none, the reservations in full)."""
        self.decode_rate = 0.0
        """The fastest stream's decode, in tokens per ms, over the last interval between
        two fresh reports (0: not seen yet)."""
        self.report_gap_ms = 0.0
        """The last interval between two fresh reports (ms; 0: not seen yet)."""
        self._report_ms: float | None = None
        if not (math.isfinite(stale_after_ms) and stale_after_ms >= 0):
            raise ValueError(
                "KvView.stale_after_ms: must be a finite number of ms >= 0 "
                f"(got {stale_after_ms!r})"
            )
        self.stale_after_ms = float(stale_after_ms)
        """The longest a report can stay fresh without a newer one (ms): the engine poller's
        ``engineMetricsStaleSeconds`` plus one failed poll (its timeout and interval). The
        decode allowance covers at least this long (``kvDecodeBooking: engine``): the gates
        book up front again only once the report is declared stale. 0: unknown (two report
        intervals only; tests)."""
        self.follows_streams = follows_streams
        """False: a backend whose streams are no engine's (the ``costmodel`` engine's chunks
        are not tokens): nothing is tracked, and the view is the books."""
        self.books_prompt_ratio = books_prompt_ratio and follows_streams
        """The KV gates book prompts at the learned ratio (:attr:`gate_prompt_ratio`;
        ``kvPromptRatio: learned``, with an engine behind the backend)."""
        self._running: dict[str, StreamProgress] = {}
        """Request id -> its progress, in the order the requests were sent to the engine."""
        self._sent = 0
        self._prefilling: frozenset[int] = frozenset()
        """The unstarted streams (by :attr:`StreamProgress.sequence`) the engine ran at its
        last report (its running count less ours that have streamed: the oldest unstarted)."""
        self._room_from: int | None = None
        """Without a clock: the first stream sent after the engine's last report if that
        report had nobody waiting: those sent since are taken as started (the engine allocates
        a prompt before its first token shows); None: it had a queue (they queue behind it),
        or no report."""
        self._clock = clock
        """Milliseconds, for the intake delay (the sidecar's model clock); None: no delay is
        learned, and a stream sent since a report with room starts at once."""
        self._room = False
        """The engine's last fresh report had nobody waiting."""
        self.intake_ms = 0.0
        """How long a request sent to the engine takes to reach it (its HTTP server, tokenizer
        and chat template, the engine's next step), learned from its reports: at a report with
        requests not counted by the engine yet, at least the oldest one's age (at once); with
        none, the youngest counted one's age pulls it down (by :data:`INTAKE_DOWN`)."""
        self.prompt_ratio = 1.0
        """The engine's prompt tokens per estimated one, learned from the usage the engine
        reports (its tokenizer and chat template against the sidecar's estimate)."""
        self._estimated = 0.0
        self._reported = 0.0
        self._view_correction: int | None = None
        """``used - modelled`` (the view's model) at the engine's last fresh report; None
        without one."""

    def track(
        self, request_id: str, stream: bool = True, bounded_end: bool = False
    ) -> StreamProgress | None:
        """A request is sent to the engine now; its progress object (the backend counts its
        stream's events on it), None if the view does not follow streams. ``bounded_end``: see
        :attr:`StreamProgress.bounded_end`."""
        if not self.follows_streams:
            return None
        sent_ms = 0.0 if self._clock is None else self._clock()
        progress = StreamProgress(self._sent, stream, sent_ms, bounded_end)
        self._running[request_id] = progress
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

    def request_ended(
        self,
        scheduler: Scheduler,
        request_id: str,
        estimated_prompt: int,
        reported_prompt: int | None,
    ) -> None:
        """A request sent to the backend ended (``reported_prompt``: the prompt tokens the
        engine reported for it, None if none): the view forgets it and learns the prompt ratio
        (:meth:`forget`), and the gates book the next admissions at the ratio it gives them
        (``scheduler.kv_prompt_ratio = gate_prompt_ratio``)."""
        self.forget(request_id, estimated_prompt, reported_prompt)
        scheduler.kv_prompt_ratio = self.gate_prompt_ratio

    @property
    def gate_prompt_ratio(self) -> float:
        """The ratio the KV gates book a prompt at now: the learned one within
        :data:`GATE_PROMPT_RATIO_BOUNDS`, or 1 (the estimate) when the books do not take it
        (:attr:`books_prompt_ratio`)."""
        if not self.books_prompt_ratio:
            return 1.0
        low, high = GATE_PROMPT_RATIO_BOUNDS
        return min(high, max(low, self.prompt_ratio))

    @property
    def running(self) -> int:
        return len(self._running)

    def gate_blocks_held(
        self,
        scheduler: Scheduler,
        running: int | None = None,
        used_blocks: int | None = None,
        decode_allowance_tokens: int = -1,
        gate_credits: dict[str, int] | None = None,
        peak: bool = False,
    ) -> int:
        """The blocks the engine surely holds for the running requests, by the gates' model:
        each stream that has shown tokens its prompt as booked (``Job.kv_prompt_tokens``: the
        estimate, times the prompt ratio at admission) and the tokens relayed, at most its
        reservation; nothing for one that has not (waiting in the engine, on its way to
        it, or being prefilled: a prompt the engine may not hold yet is never taken as held,
        so ``used - held`` never credits blocks about to be allocated); a request the books
        hold that is not tracked here (dispatched this instant, or done and its KV still held)
        at its reservation.

        With the engine's report: when it runs fewer requests (``running``) than have started
        here (streamed or sent whole), the engine has preempted the difference (vLLM frees a
        preempted request's blocks and requeues it, newest first): the most recently sent of
        the streams that have shown tokens, as many as that difference, hold nothing. And the
        total is at most the engine's ``used_blocks``: it cannot surely hold more than it
        reports in use.

        ``decode_allowance_tokens`` (``kvDecodeBooking: engine``; negative: none) adds, for
        each tracked stream, its reservation beyond what it will hold by the next report:
        ``kv_blocks - max(held, min(kv_blocks, ceil((prompt + shown + allowance) / block)))``
        (``shown``: the tokens relayed, at most ``max_tokens``; a whole answer, whose progress
        does not show, keeps its reservation), so the gates see the engine's blocks plus each
        running stream's growth over the allowance, not to its ``max_tokens``. Each tracked
        stream's share of that (its gate credit) goes into ``gate_credits`` if given (by request
        id): :meth:`~tokenfair.core.scheduler.Scheduler.observe_engine_kv` gives it back exactly
        when the request ends.

        ``peak`` (``kvDecodeBooking: peak``; no allowance) adds instead each streaming request's
        credit against the forecast peak of the running streams' blocks (:meth:`peak_credits`:
        the streams that have shown tokens, are not preempted and end by their own bound,
        :attr:`StreamProgress.bounded_end`, at most :data:`PEAK_FORECAST_MAX_STREAMS` of them;
        the others keep their reservations), into ``gate_credits`` the same way."""
        block = scheduler.policy.kv_block_tokens
        held_job = scheduler.held_job
        preempted: set[str] = set()
        if running is not None:
            started = [
                (progress.sequence, request_id)
                for request_id, progress in self._running.items()
                if progress.events or not progress.stream
            ]
            excess = len(started) - running
            if excess > 0:
                streamed = sorted(
                    (sequence, request_id)
                    for sequence, request_id in started
                    if self._running[request_id].events
                )
                preempted = {request_id for _, request_id in streamed[-excess:]}
        held = 0
        tracked = 0
        beyond = 0  # the reservations beyond the decode allowance (engine booking)
        forecast: list[tuple[int, int, int, int, str]] = []  # the peak's streams
        for request_id, progress in self._running.items():
            job = held_job(request_id)
            if job is None:
                continue
            reserved = job.kv_blocks
            tracked += reserved
            shown = min(progress.events, job.request.decode_tokens)
            surely = 0
            if progress.events and request_id not in preempted:
                surely = min(reserved, -(-(job.kv_prompt_tokens + shown) // block))
                held += surely
                if peak and progress.stream and progress.bounded_end:
                    left = job.request.decode_tokens - shown + PEAK_EVENTS_NOT_TOKENS
                    forecast.append(
                        (left, job.kv_prompt_tokens + shown, reserved, surely, request_id)
                    )
            if decode_allowance_tokens >= 0 and progress.stream:
                tokens = job.kv_prompt_tokens + shown + decode_allowance_tokens
                soon = min(reserved, -(-tokens // block))
                credit = reserved - max(soon, surely)
                beyond += credit
                if gate_credits is not None and credit > 0:
                    gate_credits[request_id] = credit
        if forecast and len(forecast) <= PEAK_FORECAST_MAX_STREAMS:
            credits = peak_credits(forecast, block)
            beyond += sum(credits.values())
            if gate_credits is not None:
                gate_credits.update(credits)
        held += max(0, scheduler.resident_blocks - tracked)
        if used_blocks is not None:
            held = min(held, max(0, used_blocks))
        return held + beyond

    def modelled_blocks(self, scheduler: Scheduler) -> int:
        """The blocks the engine holds now by the view's model (the module's docstring), each
        prompt at the engine's count (the estimate times :attr:`prompt_ratio`): a stream that
        has shown tokens its prompt and the tokens relayed (at most ``max_tokens``); an
        unstarted stream its prompt if the engine ran it at its last report, or that report
        had nobody waiting and the stream has been on its way longer than the intake delay
        (without a clock: it was sent since that report), else nothing; a whole answer its
        prompt; an untracked request of the books its reservation."""
        block = scheduler.policy.kv_block_tokens
        ratio = self.prompt_ratio
        prefilling = self._prefilling
        room_from = self._room_from
        # With a clock: a stream the engine has not reported starts once it has had the
        # intake delay to reach an engine that had room (it then allocates the prompt before
        # the first token shows); without one, at once if sent since a report with room.
        arrived_before = (
            None if self._clock is None or not self._room else self._clock() - self.intake_ms
        )
        held_job = scheduler.held_job
        held = 0
        tracked = 0
        for request_id, progress in self._running.items():
            job = held_job(request_id)
            if job is None:
                continue
            tracked += job.kv_blocks
            request = job.request
            prompt = math.ceil(request.prefill_tokens * ratio)
            if progress.events:
                held += -(-(prompt + min(progress.events, request.decode_tokens)) // block)
            elif (
                not progress.stream
                or progress.sequence in prefilling
                or (room_from is not None and progress.sequence >= room_from)
                or (arrived_before is not None and progress.sent_ms < arrived_before)
            ):
                held += -(-prompt // block)
        return held + max(0, scheduler.resident_blocks - tracked)

    def observe(
        self,
        scheduler: Scheduler,
        used_blocks: int | None,
        running: int | None = None,
        waiting: int = 0,
    ) -> None:
        """A fresh report of the engine (``used_blocks`` in use, ``running`` requests it runs
        and ``waiting`` it holds waiting), or None: no fresh report. Sets the core's
        correction (the gates' model) and the view's."""
        if used_blocks is None:
            self._prefilling = frozenset()
            self._room_from = None
            self._room = False
            self._view_correction = None
            self._report_ms = None
            self.decode_allowance_tokens = -1
            scheduler.observe_engine_kv(None)
            return
        pending = [p for p in self._running.values() if p.stream and not p.events]
        unstarted = [p.sequence for p in pending]
        if running is not None:
            started = sum(1 for p in self._running.values() if p.events or not p.stream)
            prefilling = min(len(unstarted), max(0, running - started))
            if self._clock is not None:
                # The engine counts `running + waiting` requests. Surely among them: our
                # streams that have shown tokens and not their `[DONE]`. Perhaps: the whole
                # answers (on their way to it, or not). Of the unstarted streams, then, it
                # counts at most `most` and at least `least` (the oldest first).
                streaming = sum(1 for p in self._running.values() if p.events and not p.done)
                whole = sum(1 for p in self._running.values() if not p.stream)
                counted = running + waiting - streaming
                self._learn_intake(pending, counted, counted - whole, self._clock())
        else:
            prefilling = max(0, len(unstarted) - waiting)
        self._prefilling = frozenset(unstarted[:prefilling])
        # An engine with nobody waiting starts what it is sent (its prompt is allocated
        # before the first token shows) once it has it; one with a queue queues it.
        self._room = waiting == 0
        self._room_from = self._sent if waiting == 0 and self._clock is None else None
        allowance = self._decode_allowance(scheduler.policy.kv_block_tokens)
        peak = self.decode_booking == "peak"
        if not scheduler.takes_decode_allowance:
            allowance = -1  # the lesson's policies book up front whatever the setting
            peak = False
        self.decode_allowance_tokens = allowance
        credits: dict[str, int] = {}
        held = self.gate_blocks_held(scheduler, running, used_blocks, allowance, credits, peak)
        scheduler.observe_engine_kv(used_blocks, held - sum(credits.values()), allowance, credits)
        self._view_correction = used_blocks - self.modelled_blocks(scheduler)

    def _decode_allowance(self, block_tokens: int) -> int:
        """At a fresh report: the decode tokens the gates book each running stream beyond
        what it has shown (``engine`` mode; -1 in ``upfront``)::

            allowance = max(block, ceil(rate * max(DECODE_HORIZON_REPORTS * gap, stale_after)))

        ``rate``: the fastest stream's tokens relayed per ms since the previous fresh report,
        ``gap``: the time since it (:attr:`decode_rate`, :attr:`report_gap_ms`; both 0 at the
        first report, or without a clock); ``stale_after``: :attr:`stale_after_ms` (the gates
        keep this booking until the report is declared stale). At least one block: a stream's
        next token may open one. Learns the rate from the streams' events at this report and
        the last."""
        now_ms = None if self._clock is None else self._clock()
        last_ms = self._report_ms
        self._report_ms = now_ms
        if now_ms is not None and last_ms is not None and now_ms > last_ms:
            gap_ms = now_ms - last_ms
            fastest = 0
            for progress in self._running.values():
                if progress.events_at_report >= 0:
                    fastest = max(fastest, progress.events - progress.events_at_report)
            self.report_gap_ms = gap_ms
            self.decode_rate = fastest / gap_ms
        for progress in self._running.values():
            progress.events_at_report = progress.events
        if self.decode_booking != "engine":
            return -1
        horizon_ms = max(DECODE_HORIZON_REPORTS * self.report_gap_ms, self.stale_after_ms)
        growth = self.decode_rate * horizon_ms
        return max(block_tokens, math.ceil(round(growth, 9)))

    def _learn_intake(
        self, pending: list[StreamProgress], most: int, least: int, now_ms: float
    ) -> None:
        """At a report: of the streams that have shown nothing (in the order sent), the
        engine counts (running or waiting) at most the oldest ``most`` and at least the oldest
        ``least``; the others are on their way to it. If even ``most`` leaves one out, the
        oldest left out has taken longer than its age: the delay is at least that; else the
        youngest surely counted one took at most its age: the delay moves toward it. Evidence
        that depends on what the engine does with a whole answer or a stream it has finished
        moves nothing."""
        most = min(len(pending), max(0, most))
        least = min(most, max(0, least))
        if most < len(pending):
            age_ms = now_ms - pending[most].sent_ms
            self.intake_ms = min(INTAKE_MAX_MS, max(self.intake_ms, age_ms))
        elif least:
            age_ms = now_ms - pending[least - 1].sent_ms
            if age_ms < self.intake_ms:
                self.intake_ms += INTAKE_DOWN * (max(0.0, age_ms) - self.intake_ms)

    def view_blocks(self, scheduler: Scheduler) -> int:
        """The blocks the engine holds now, as the sidecar sees them: the model corrected by
        the engine's last report (the model alone without one)."""
        return max(0, self.modelled_blocks(scheduler) + (self._view_correction or 0))


class KvViewCollector(Collector):
    """``tokenfair_kv_view_ratio``: the engine's KV cache in use as the sidecar sees it now."""

    def __init__(self, view: KvView, scheduler: Callable[[], Scheduler]) -> None:
        self._view = view
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        scheduler = self._scheduler()
        view = self._view
        yield GaugeMetricFamily(
            "tokenfair_kv_prompt_ratio",
            "The engine's prompt tokens per estimated one, learned from the usage it reports.",
            view.prompt_ratio,
        )
        yield GaugeMetricFamily(
            "tokenfair_kv_gate_prompt_ratio",
            "The prompt ratio the KV gates book a request admitted now at (kvPromptRatio: "
            "learned, bounded; 1: the estimate).",
            scheduler.kv_prompt_ratio,
        )
        yield GaugeMetricFamily(
            "tokenfair_kv_view_ratio",
            "KV blocks the engine holds now as the sidecar sees them (the running requests' "
            "prompts and decoded tokens, corrected by the engine's last report) over total KV "
            "blocks.",
            self._view.view_blocks(scheduler) / scheduler.policy.total_kv_blocks,
        )
