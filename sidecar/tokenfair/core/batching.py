"""The model server as a batching engine: its throughput at each concurrency, and the requests
running on it as a processor-sharing fluid.

A continuous-batching engine (vLLM, SGLang) runs up to ``S`` requests at once
(``maxBatchRequests``, vLLM's ``--max-num-seqs``). Each engine step advances every running
request by one token, and a step holding ``c`` requests takes ``alpha + beta * c`` ms (the fixed
cost of a forward pass, and the part that grows with the batch). Counted in service tokens
(``prefill + decodeWeight * decode``), each of ``c`` running requests then advances at the same
speed and the engine's throughput grows with ``c`` until it saturates::

    v(c) = 1 / (a + b * c)          speed of each of c running requests, service tokens per ms
    X(c) = c * v(c)                 the engine's throughput at concurrency c

``a`` and ``b`` are fixed by the policy: the engine's throughput at its full batch, ``X(S) = R``
(``serviceTokensPerMs``, the capacity every other part of tokenfair prices waits and
utilisation with), and how much more that is than one request running alone delivers,
``G = X(S) / X(1)`` (``batchThroughputGain``), so ``X(1) = r1 = R / G``::

    b = (S / R - 1 / r1) / (S - 1)      a = 1 / r1 - b          (S > 1, 1 <= G <= S)

``G = 1`` (the default) is a fixed throughput shared by the batch (``a = 0``: ``X(c) = R``, each
request at ``R / c``); ``G = S`` is throughput that grows linearly with the batch (``b = 0``:
every request at ``r1`` whatever runs beside it). ``S = 1`` is the lesson's serial
server (``v(1) = X(1) = R``), which the rest of the core keeps modelling exactly as before.
``tokenfair calibrate`` fits ``R`` and ``G`` from records taken under load
(docs/calibration.md).

:class:`RunningWork` holds the requests running on the engine as a fluid: they share the
engine equally (processor sharing, which is what one token per request per step is), so one
virtual clock ``V`` — the service each running request has received since the engine started,
advancing at ``v(c)`` — tells every request's progress at once. A request of ``s`` expected
service tokens started at virtual time ``V0`` is forecast to end when ``V = V0 + s`` (its
*tag*); the forecast ends are kept in a heap, so the next departure, and every request's
remaining work, are O(log n) to know. More than ``S`` requests never run: one sent beyond the
batch waits in the engine's own FIFO until a slot frees (a sidecar sends at most ``S``).

What the fluid leaves out, stated: prefill and decode share one speed (an engine runs a long
prefill in chunks, slowing its neighbours for a few steps, not evenly); a request's progress on
a real engine is only forecast here (the server settles a request when the engine says it has
ended, whatever the forecast said, and a request the forecast says is overdue is counted as
ending now).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from tokenfair.config import PolicyConfig
from tokenfair.core.cost import CostModel


@dataclass(frozen=True, slots=True)
class BatchingCurve:
    """``v(c) = 1 / (a + b c)`` and ``X(c) = c v(c)`` for ``c`` in ``[1, S]`` (the module
    docstring derives ``a`` and ``b`` from ``S``, ``r1`` and ``R``)."""

    max_batch_requests: int
    """``S``: the most requests the engine runs at once."""
    service_tokens_per_ms: float
    """``R = X(S)``: the engine's throughput at its full batch."""
    request_service_tokens_per_ms: float
    """``r1 = X(1)``: the speed of one request running alone."""
    per_request_ms: float
    """``a``: ms per service token of a request, the part that does not grow with the batch."""
    per_batched_request_ms: float
    """``b``: ms per service token of a request for each request running (itself included)."""

    @classmethod
    def of(
        cls, max_batch_requests: int, service_tokens_per_ms: float, request_tokens_per_ms: float
    ) -> BatchingCurve:
        """The curve through ``X(1) = r1`` and ``X(S) = R``; ``ValueError`` unless ``S >= 1``,
        ``R > 0`` and ``R / S <= r1 <= R`` (a batch neither slows the engine down nor runs
        more than ``S`` requests' worth faster than one alone)."""
        batch, rate, single = max_batch_requests, service_tokens_per_ms, request_tokens_per_ms
        if batch < 1 or not rate > 0.0 or not math.isfinite(rate):
            raise ValueError(f"need S >= 1 and a finite R > 0 (got S={batch}, R={rate})")
        if batch == 1:
            return cls(1, rate, rate, 1.0 / rate, 0.0)
        # A relative tolerance: r1 = R / S and r1 = R are the ends users write, and the
        # operator or a YAML reader may hand them back one ulp off.
        low, high = rate / batch, rate
        if not low * (1 - 1e-12) <= single <= high * (1 + 1e-12):
            raise ValueError(
                f"one request's speed must be in [R / S, R] = [{low:g}, {high:g}] (got "
                f"{single:g}): batchThroughputGain in [1, maxBatchRequests]"
            )
        single = min(max(single, low), high)
        slope = max(0.0, (batch / rate - 1.0 / single) / (batch - 1))
        return cls(batch, rate, single, max(0.0, 1.0 / single - slope), slope)

    @classmethod
    def from_policy(cls, policy: PolicyConfig) -> BatchingCurve:
        rate = policy.service_tokens_per_ms
        return cls.of(policy.max_batch_requests, rate, rate / policy.batch_throughput_gain)

    @classmethod
    def from_cost(cls, cost: CostModel) -> BatchingCurve:
        """The curve of a cost model (its policy's ``maxBatchRequests``,
        ``serviceTokensPerMs`` and ``batchThroughputGain``): the engine the simulator replays
        and the ``costmodel`` backend runs."""
        rate = cost.service_tokens_per_ms
        return cls.of(cost.max_batch_requests, rate, rate / cost.batch_throughput_gain)

    def request_speed(self, running: int) -> float:
        """``v(c)``: service tokens per ms of each of ``running`` requests (``c`` is taken in
        ``[1, S]``: beyond the batch the engine queues, it does not share further)."""
        c = min(max(running, 1), self.max_batch_requests)
        return 1.0 / (self.per_request_ms + self.per_batched_request_ms * c)

    def throughput(self, running: int) -> float:
        """``X(c) = c v(c)``, the engine's service tokens per ms with ``running`` requests."""
        c = min(max(running, 1), self.max_batch_requests)
        return c * self.request_speed(c)

    def slowdown(self, running: int) -> float:
        """How much slower a request runs beside ``running - 1`` others than alone:
        ``v(1) / v(c)`` (1 for a serial engine). The time to a request's first token
        stretches by it too."""
        return self.request_speed(1) / self.request_speed(running)


class RunningWork:
    """The requests running on the engine, as a processor-sharing fluid over one virtual clock
    (the module docstring). Pure: time is passed in (ms, never backwards); O(log n) a call.

    ``start`` a request when it is dispatched, ``finish`` it when the engine says it ended
    (or, in a replay, when :meth:`next_departure_ms` says it does). A request sent while ``S``
    run waits FIFO for a slot, counted in :attr:`waiting`."""

    __slots__ = (
        "_at_ms",
        "_curve",
        "_heap",
        "_sequence",
        "_sizes",
        "_tags",
        "_virtual",
        "_waiting",
        "expected_tokens",
    )

    def __init__(self, curve: BatchingCurve) -> None:
        self._curve = curve
        self._virtual = 0.0  # V: service each running request has had, service tokens
        self._at_ms = 0.0  # when V was last brought up to date
        self._tags: dict[str, float] = {}  # running request -> V at which it is forecast to end
        self._sizes: dict[str, float] = {}  # running request -> its expected service tokens
        self._heap: list[tuple[float, int, str]] = []  # (tag, order, id); stale entries skipped
        self._sequence = 0
        self._waiting: dict[str, float] = {}  # sent beyond the batch, FIFO: id -> expected
        self.expected_tokens = 0.0
        """Expected service tokens of every request started and not finished (running or
        waiting for a slot), as dispatched: the work the engine holds."""

    @property
    def curve(self) -> BatchingCurve:
        return self._curve

    def retune(self, curve: BatchingCurve, now_ms: float) -> None:
        """A reload changed the coefficients: progress so far stands, the new speed applies
        from ``now_ms`` on."""
        self._advance(now_ms)
        self._curve = curve
        self._admit_waiting()

    @property
    def running(self) -> int:
        """Requests running (at most ``S``)."""
        return len(self._tags)

    @property
    def waiting(self) -> int:
        """Requests sent beyond the batch, waiting in the engine for a slot."""
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tags or request_id in self._waiting

    def _advance(self, now_ms: float) -> None:
        elapsed_ms = now_ms - self._at_ms
        if elapsed_ms > 0.0:
            running = len(self._tags)
            if running:
                self._virtual += elapsed_ms * self._curve.request_speed(running)
            self._at_ms = now_ms

    def start(self, request_id: str, expected_tokens: float, now_ms: float) -> None:
        """A request of ``expected_tokens`` service tokens was sent to the engine at
        ``now_ms``: it runs at once if a slot is free, else it waits for one."""
        self._advance(now_ms)
        self.expected_tokens += expected_tokens
        if len(self._tags) < self._curve.max_batch_requests:
            self._run(request_id, expected_tokens)
        else:
            self._waiting[request_id] = expected_tokens

    def _run(self, request_id: str, expected_tokens: float) -> None:
        tag = self._virtual + expected_tokens
        self._tags[request_id] = tag
        self._sizes[request_id] = expected_tokens
        self._sequence += 1
        heapq.heappush(self._heap, (tag, self._sequence, request_id))

    def finish(self, request_id: str, now_ms: float, expected_tokens: float) -> None:
        """The request ended (or left) at ``now_ms``; ``expected_tokens`` is what
        :meth:`start` was given. Its slot goes to the first request waiting for one. A
        request not held is ignored (settlement after a failed start)."""
        self._advance(now_ms)
        if self._tags.pop(request_id, None) is None:
            if self._waiting.pop(request_id, None) is None:
                return
        else:
            del self._sizes[request_id]
        self.expected_tokens -= expected_tokens
        if self.expected_tokens < 0.0 or not (self._tags or self._waiting):
            self.expected_tokens = 0.0  # float residue of the sums: exactly 0 when empty
        self._admit_waiting()
        self._drop_stale()

    def _admit_waiting(self) -> None:
        batch = self._curve.max_batch_requests
        waiting = self._waiting
        while waiting and len(self._tags) < batch:
            request_id = next(iter(waiting))
            self._run(request_id, waiting.pop(request_id))

    def _drop_stale(self) -> None:
        heap, tags = self._heap, self._tags
        while heap and tags.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)

    def finish_first(self, now_ms: float) -> str:
        """End the request the forecast ends first, at ``now_ms`` (a time the caller took from
        :meth:`next_departure_ms`, or later), and return its id; ``KeyError`` if nothing runs.
        The virtual clock is brought up to the request's tag if it is short of it: the time of
        its end was computed by a division and an addition, and float noise must neither end it
        early nor leave it running for an ulp more (an engine replayed on its own forecast, such
        as the simulator's, ends exactly the requests the forecast says, in its order).
        Requests tied with it are then overdue (:meth:`next_departure_ms` is 0)."""
        self._advance(now_ms)
        self._drop_stale()
        if not self._heap:
            raise KeyError("no request is running")
        tag, _, request_id = heapq.heappop(self._heap)
        if tag > self._virtual:
            self._virtual = tag
        del self._tags[request_id]
        size = self._sizes.pop(request_id)
        self.expected_tokens -= size
        if self.expected_tokens < 0.0 or not (self._tags or self._waiting):
            self.expected_tokens = 0.0  # float residue of the sums: exactly 0 when empty
        self._admit_waiting()
        self._drop_stale()
        return request_id

    def remaining_tokens(self, request_id: str, now_ms: float) -> float:
        """Service tokens the request still needs by the forecast (0 when overdue; its whole
        expectation while it waits for a slot)."""
        self._advance(now_ms)
        tag = self._tags.get(request_id)
        if tag is None:
            return self._waiting.get(request_id, 0.0)
        return max(0.0, tag - self._virtual)

    def attained_tokens(self, request_id: str, now_ms: float) -> float:
        """Service the request has had since it started running (0 while it waits)."""
        self._advance(now_ms)
        tag = self._tags.get(request_id)
        if tag is None:
            return 0.0
        return min(self._sizes[request_id], self._virtual - (tag - self._sizes[request_id]))

    def next_departure_ms(self, now_ms: float) -> float:
        """ms from ``now_ms`` until the forecast's next end (0 if one is overdue); ``inf``
        when nothing runs."""
        self._advance(now_ms)
        self._drop_stale()
        if not self._heap:
            return math.inf
        remaining = self._heap[0][0] - self._virtual
        if remaining <= 0.0:
            return 0.0
        return remaining / self._curve.request_speed(len(self._tags))

    def slot_wait_ms(self, now_ms: float) -> float:
        """ms until a slot is free for a request sent now: 0 if fewer than ``S`` run, else the
        forecast's next end, plus one more for each request already waiting for a slot."""
        if len(self._tags) < self._curve.max_batch_requests:
            return 0.0
        first_ms = self.next_departure_ms(now_ms)
        if not self._waiting:
            return first_ms
        # Those already waiting take the next slots: in the fluid, one slot frees every mean
        # remaining run at the full batch's speed.
        mean_remaining = max(0.0, self.expected_tokens - sum(self._waiting.values())) / max(
            1, len(self._tags)
        )
        return first_ms + len(self._waiting) * mean_remaining / self._curve.throughput(
            self._curve.max_batch_requests
        )

    def departures(self, now_ms: float) -> list[tuple[float, str]]:
        """Every running request's forecast end, as ``(ms from now_ms, id)`` in the order the
        forecast ends them, assuming nothing else starts. O(n log n); for the KV forecast of a
        request that does not fit now."""
        self._advance(now_ms)
        order = sorted((tag, request_id) for request_id, tag in self._tags.items())
        ends: list[tuple[float, str]] = []
        virtual = self._virtual
        elapsed_ms = 0.0
        running = len(order)
        for tag, request_id in order:
            if tag > virtual:
                elapsed_ms += (tag - virtual) / self._curve.request_speed(running)
                virtual = tag
            ends.append((elapsed_ms, request_id))
            running -= 1
        return ends
