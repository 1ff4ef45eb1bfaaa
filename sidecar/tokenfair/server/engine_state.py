"""The engine in the loop: what the model server itself reports, read while the sidecar runs.

The scheduling core keeps *books* — KV blocks reserved at dispatch (prompt and ``max_tokens``),
freed at completion — and prices waits with a model of the engine. Both are estimates. A real
engine says what it holds: this module polls the upstream's Prometheus ``/metrics`` (every
``engineMetricsIntervalMs``, default 250 ms) for

* its KV cache in use (a fraction of its blocks), the requests it runs and the requests it holds
  waiting, under the names of the engine profile (:data:`ENGINES`: vLLM, SGLang, or names of
  your own, as the Gateway API Inference Extension's model-server protocol lists them);
* its cache geometry (vLLM's ``vllm:cache_config_info`` labels ``block_size`` and
  ``num_gpu_blocks``): the sidecar adopts the engine's block size and block count over the
  config document's (``totalKvBlocks``, ``kvBlockTokens`` need not be copied by hand);

and, at start (again every :data:`LIMITS_REFRESH_S` while it fails), ``GET /v1/models`` for each
model's ``max_model_len`` and ``GET /openapi.json`` for the routes the engine serves (vLLM
registers ``/v1/embeddings`` only for a model that can embed), in a task beside the polls (a
slow answer never delays one).

Each report corrects the sidecar's model of the engine's KV (:mod:`tokenfair.server.kv_view`,
:meth:`~tokenfair.core.scheduler.Scheduler.observe_engine_kv`): KV gates then see the engine's
blocks in use plus every running request's remaining growth to its reservation, instead of the
books alone, and ``/status`` ``kv.view_blocks`` what the engine holds now. A report older than
``engineMetricsStaleMs`` (default 2 s) — the engine's metrics unreachable, unparsable, or
missing the names — is dropped: the gates fall back to the books, visibly: ``/status``
(``kv.source``, ``engine``), the metric ``tokenfair_engine_metrics_fresh`` and one log line per
change of state.

Bounded: one poll at a time, each within the interval (at least 1 s) and
:data:`MAX_METRICS_BYTES`; the parser reads only the lines of the names it looks for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenfair.core.reasons import Reason
from tokenfair.server.clock import EventClock, ModelClock

log = logging.getLogger("tokenfair.sidecar")

MAX_METRICS_BYTES: Final = 8 << 20
"""Largest ``/metrics`` page read (vLLM's is ~50-200 KB; a histogram-heavy one a few MB)."""
MAX_LIMITS_BYTES: Final = 4 << 20
"""Largest ``/v1/models`` or ``/openapi.json`` answer read."""
LIMITS_REFRESH_S: Final = 30.0
"""How long after a failed read of the engine's model list or routes it is read again."""


def poll_timeout_s(interval_s: float) -> float:
    """A metrics poll's timeout: the poll interval, at least 1 s."""
    return max(1.0, interval_s)


def fresh_at_most_s(interval_s: float, stale_s: float) -> float:
    """The longest a report stays fresh without a newer one: ``stale_s``, then the next
    failed poll (within one interval, then its timeout) declares it stale::

        stale_s + interval_s + max(1, interval_s)

    (3.25 s with the defaults). The horizon of ``kvDecodeBooking: engine``'s decode allowance
    (:class:`~tokenfair.server.kv_view.KvView`'s ``stale_after_ms``)."""
    return stale_s + interval_s + poll_timeout_s(interval_s)


EngineGet = Callable[[str, float, int], Awaitable["tuple[int, bytes] | None"]]
"""``get(path, timeout_s, limit_bytes) -> (status, body)`` from the engine (the backend's own
connection and key); None: this backend has no engine to ask."""


@dataclass(frozen=True, slots=True)
class EngineMetricNames:
    """Where an engine reports its state: metric names tried in order (the first one present
    wins; several series of one name — one per model or data-parallel rank — are summed, a
    ratio averaged)."""

    kv_usage_ratio: tuple[str, ...]
    """Fraction of the KV cache in use, 0..1."""
    running: tuple[str, ...]
    """Requests the engine is running."""
    waiting: tuple[str, ...]
    """Requests the engine holds waiting (not started: no KV yet)."""
    cache_info: tuple[str, ...] = ()
    """An info metric whose labels give the cache geometry."""
    block_size_label: str = "block_size"
    num_blocks_label: str = "num_gpu_blocks"


ENGINES: Final[Mapping[str, EngineMetricNames]] = {
    "vllm": EngineMetricNames(
        kv_usage_ratio=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        cache_info=("vllm:cache_config_info",),
    ),
    "sglang": EngineMetricNames(
        kv_usage_ratio=("sglang:token_usage",),
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
    ),
}
"""The engine profiles ``engineMetrics`` names (``auto``: the first whose names are present)."""


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One reading of the engine's state (None where the engine did not say)."""

    kv_usage_ratio: float
    running: float | None = None
    waiting: float | None = None
    block_size: int | None = None
    num_blocks: int | None = None


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _samples(text: str, names: frozenset[str]) -> dict[str, list[tuple[str, float]]]:
    """``name -> [(labels text, value)]`` for the sample lines of ``names`` (comments and
    other metrics skipped without parsing them)."""
    found: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        cut = line.find("{")
        if cut < 0:
            cut = line.find(" ")
        if cut <= 0 or line[:cut] not in names:
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            found.setdefault(match.group(1), []).append((match.group(2) or "", value))
    return found


def _first(found: dict[str, list[tuple[str, float]]], names: Sequence[str]) -> list[float]:
    for name in names:
        if name in found:
            return [value for _, value in found[name]]
    return []


def _label_int(labels: str, name: str) -> int | None:
    for key, value in _LABEL.findall(labels):
        if key == name:
            try:
                number = int(float(value))
            except ValueError:
                return None
            return number if number > 0 else None
    return None


def parse_engine_metrics(text: str, names: EngineMetricNames) -> EngineReport | None:
    """The engine's state from a Prometheus text page; None if the page lacks the KV-usage
    metric (the one the sidecar cannot do without). Values out of range are clamped (a usage
    ratio to [0, 1], counts to >= 0)."""
    wanted = frozenset((*names.kv_usage_ratio, *names.running, *names.waiting,
                        *names.cache_info))  # fmt: skip
    found = _samples(text, wanted)
    usage = _first(found, names.kv_usage_ratio)
    if not usage:
        return None
    ratio = min(1.0, max(0.0, sum(usage) / len(usage)))
    running = _first(found, names.running)
    waiting = _first(found, names.waiting)
    block_size = num_blocks = None
    for name in names.cache_info:
        for labels, _ in found.get(name, ()):
            block_size = _label_int(labels, names.block_size_label)
            num_blocks = _label_int(labels, names.num_blocks_label)
            break
        if block_size is not None or num_blocks is not None:
            break
    return EngineReport(
        kv_usage_ratio=ratio,
        running=max(0.0, sum(running)) if running else None,
        waiting=max(0.0, sum(waiting)) if waiting else None,
        block_size=block_size,
        num_blocks=num_blocks,
    )


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What the engine serves: each model's context length and the routes it has (None: not
    known)."""

    max_model_len: Mapping[str, int] = field(default_factory=dict)
    routes: frozenset[str] | None = None

    def context_tokens(self, model: object) -> int | None:
        """The context length of ``model`` (the only one when the request names none, or a
        name the engine does not list: the engine answers that itself)."""
        lengths = self.max_model_len
        if isinstance(model, str) and model in lengths:
            return lengths[model]
        if len(lengths) == 1:
            return next(iter(lengths.values()))
        return None


ROUTE_NOT_SERVED: Final = Reason.ROUTE_NOT_SERVED
"""``404`` code: the engine does not serve this route (e.g. embeddings of a generative model)."""
CONTEXT_LENGTH_EXCEEDED: Final = Reason.CONTEXT_LENGTH_EXCEEDED
"""``400`` code (OpenAI's): the request asks for more tokens than the model's context holds."""


@dataclass(frozen=True, slots=True)
class LimitRefusal:
    """A request the engine would refuse, answered before admission (it holds no slot, books
    no KV and charges no budget)."""

    status: int
    code: str
    message: str
    param: str | None = None


def asked_max_tokens(body: Mapping[str, object]) -> int | None:
    """The request's own ``max_tokens`` or ``max_completion_tokens`` (the larger, as an engine
    that honours either would generate), None if it sets neither (the engine then fills the
    context)."""
    asked = [
        value
        for key in ("max_tokens", "max_completion_tokens")
        if isinstance(value := body.get(key), int) and not isinstance(value, bool)
    ]
    return max(asked) if asked else None


def limit_refusal(
    limits: EngineLimits, path: str, model: object, max_tokens: int | None
) -> LimitRefusal | None:
    """What the engine would refuse for certain, from what it said it serves: a route it does
    not have (``404 route_not_served``), or a ``max_tokens`` at or past the model's context
    length, leaving no room for a prompt (``400 context_length_exceeded``). A prompt that may
    not fit is left to the engine: the sidecar's prompt count is an estimate, and the engine
    refuses at once, without running anything."""
    if limits.routes is not None and path not in limits.routes:
        return LimitRefusal(
            404, ROUTE_NOT_SERVED, f"the model server behind this sidecar does not serve {path}"
        )
    context = limits.context_tokens(model)
    if context is not None and max_tokens is not None and max_tokens >= context:
        return LimitRefusal(
            400,
            CONTEXT_LENGTH_EXCEEDED,
            f"max_tokens: {max_tokens} leaves no room for a prompt in the model's context of "
            f"{context} tokens",
            "max_tokens",
        )
    return None


def parse_models(data: bytes) -> dict[str, int]:
    """``model id -> max_model_len`` from an OpenAI ``/v1/models`` answer (vLLM adds
    ``max_model_len``; models without it are left out)."""
    try:
        listing = json.loads(data)
    except ValueError:
        return {}
    entries = listing.get("data") if isinstance(listing, dict) else None
    lengths: dict[str, int] = {}
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, dict):
            continue
        model, length = entry.get("id"), entry.get("max_model_len")
        if (
            isinstance(model, str)
            and isinstance(length, int)
            and not isinstance(length, bool)
            and length > 0
        ):
            lengths[model] = length
    return lengths


def parse_routes(data: bytes) -> frozenset[str] | None:
    """The ``POST`` paths of an OpenAPI document (None if it is not one)."""
    try:
        document = json.loads(data)
    except ValueError:
        return None
    paths = document.get("paths") if isinstance(document, dict) else None
    if not isinstance(paths, dict):
        return None
    return frozenset(
        path for path, methods in paths.items() if isinstance(methods, dict) and "post" in methods
    )


class EngineState:
    """The poller and what it last saw. ``on_report`` gets each fresh report, ``on_stale`` is
    called once when reports stop being fresh (both on the event loop)."""

    def __init__(
        self,
        get: EngineGet,
        *,
        engine: str,
        custom: EngineMetricNames | None,
        metrics_path: str,
        interval_s: float,
        stale_s: float,
        on_report: Callable[[EngineReport], None],
        on_stale: Callable[[str], None],
        on_limits: Callable[[EngineLimits], None],
        clock: EventClock | None = None,
    ) -> None:
        self._get = get
        self._clock: EventClock = clock or ModelClock()
        """The poll's timer and the freshness of reports (real seconds)."""
        self.engine = engine
        """``auto``, a name of :data:`ENGINES`, or ``custom``."""
        self._custom = custom
        self.metrics_path = metrics_path
        self.interval_s = interval_s
        self.stale_s = stale_s
        self._on_report = on_report
        self._on_stale = on_stale
        self._on_limits = on_limits
        self.names: EngineMetricNames | None = custom if engine == "custom" else ENGINES.get(engine)
        self.last: EngineReport | None = None
        self.last_at_s: float | None = None
        """Clock time (real seconds) of the last fresh report."""
        self.fresh = False
        self.problem = "no report yet"
        """Why there is no fresh report ("" while fresh)."""
        self.polls = 0
        self.failures = 0
        self.limits = EngineLimits()
        self._limits_read = False

    def status(self) -> dict[str, Any]:
        """For ``/status``: which engine, whether its report is fresh, what it said."""
        last = self.last
        return {
            "engine": self.engine if self.names is None or self.engine != "auto"
            else f"auto ({self._profile_name()})",
            "fresh": self.fresh,
            "problem": self.problem or None,
            "kv_usage_ratio": None if last is None else last.kv_usage_ratio,
            "running": None if last is None else last.running,
            "waiting": None if last is None else last.waiting,
            "block_size": None if last is None else last.block_size,
            "num_blocks": None if last is None else last.num_blocks,
            "max_model_len": dict(self.limits.max_model_len),
            "polls": self.polls,
            "failures": self.failures,
        }  # fmt: skip

    def _profile_name(self) -> str:
        for name, names in ENGINES.items():
            if names is self.names:
                return name
        return "custom"

    async def run(self) -> None:
        """Poll until cancelled; never raises otherwise."""
        clock = self._clock
        next_limits_s = 0.0
        reading: asyncio.Task[None] | None = None
        try:
            while True:
                started = clock.monotonic_s()
                if (
                    not self._limits_read
                    and started >= next_limits_s
                    and (reading is None or reading.done())
                ):
                    # In a task of its own: its requests (5 s timeouts) never hold a poll back,
                    # so a report is declared stale on time (the stale limit and one failed
                    # poll: the horizon of kvDecodeBooking: engine's allowance, KvView).
                    reading = asyncio.create_task(self._read_limits_logged())
                    next_limits_s = started + LIMITS_REFRESH_S
                try:
                    await self.poll_once()
                except Exception:
                    log.exception("polling the engine's metrics failed")
                    self._failed("the poll raised (see the log)")
                elapsed = clock.monotonic_s() - started
                await clock.sleep(max(0.0, self.interval_s - elapsed))
        finally:
            if reading is not None:
                reading.cancel()

    async def _read_limits_logged(self) -> None:
        try:
            await self._read_limits()
        except Exception:  # a bug here must not stop the poller
            log.exception("reading the engine's models and routes failed")

    async def poll_once(self) -> None:
        """One poll: a fresh report goes to ``on_report``; a failure is counted, and once the
        last report is older than ``stale_s`` the gates fall back (``on_stale``)."""
        self.polls += 1
        timeout_s = poll_timeout_s(self.interval_s)
        try:
            answer = await self._get(self.metrics_path, timeout_s, MAX_METRICS_BYTES)
        except Exception as exc:  # the backend's own errors: unreachable, timeout, too large
            self._failed(f"GET {self.metrics_path}: {type(exc).__name__}: {exc}")
            return
        if answer is None:
            self._failed("this backend has no engine metrics")
            return
        status, data = answer
        if status != 200:
            self._failed(f"GET {self.metrics_path}: HTTP {status}")
            return
        text = data.decode("utf-8", "replace")
        report = self._parse(text)
        if report is None:
            self._failed(f"GET {self.metrics_path}: no KV-usage metric of the "
                         f"{self.engine!r} engine profile in the answer")  # fmt: skip
            return
        was_fresh = self.fresh
        self.last = report
        self.last_at_s = self._clock.monotonic_s()
        self.fresh = True
        self.problem = ""
        if not was_fresh:
            log.info(
                "engine metrics: reading the engine's KV and queue (%s)", self.status()["engine"]
            )
        self._on_report(report)

    def _parse(self, text: str) -> EngineReport | None:
        if self.names is not None:
            return parse_engine_metrics(text, self.names)
        for names in ENGINES.values():  # auto: the first profile whose names are there
            report = parse_engine_metrics(text, names)
            if report is not None:
                self.names = names
                return report
        return None

    def _failed(self, problem: str) -> None:
        self.failures += 1
        self.problem = problem
        now_s = self._clock.monotonic_s()
        if self.fresh and (self.last_at_s is None or now_s - self.last_at_s > self.stale_s):
            self.fresh = False
            log.warning("engine metrics: no fresh report for %g s (%s); KV gates use the "
                        "sidecar's books until the engine answers again", self.stale_s,
                        problem)  # fmt: skip
            self._on_stale(problem)
        elif self.polls == 1 or (not self.fresh and self.failures & (self.failures - 1) == 0):
            log.warning("engine metrics unavailable (%s); KV gates use the sidecar's books",
                        problem)  # fmt: skip

    async def _read_limits(self) -> None:
        lengths: dict[str, int] = {}
        routes: frozenset[str] | None = None
        answered = False
        for path in ("/v1/models", "/openapi.json"):
            try:
                answer = await self._get(path, 5.0, MAX_LIMITS_BYTES)
            except Exception as exc:
                log.info("engine limits: GET %s failed (%s: %s)", path, type(exc).__name__, exc)
                continue
            if answer is None:
                self._limits_read = True  # nothing to ask
                return
            status, data = answer
            if status != 200:
                continue
            answered = True
            if path == "/v1/models":
                lengths = parse_models(data)
            else:
                routes = parse_routes(data)
        if not answered:
            return
        self._limits_read = True
        self.limits = EngineLimits(lengths, routes)
        log.info("engine limits: max_model_len %s; routes %s", lengths or "unknown",
                 "unknown" if routes is None else ", ".join(sorted(routes)))  # fmt: skip
        self._on_limits(self.limits)


class EngineCollector(Collector):
    """``tokenfair_engine_*``: what the engine last reported, and whether it is fresh."""

    def __init__(self, engine: EngineState) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        yield GaugeMetricFamily(
            "tokenfair_engine_metrics_fresh",
            "1 while the engine's own report is fresh and KV gates use it; 0: the sidecar's "
            "books alone.",
            1.0 if engine.fresh else 0.0,
        )
        yield CounterMetricFamily(
            "tokenfair_engine_metrics_failures",
            "Polls of the engine's metrics that gave no report.",
            engine.failures,
        )
        last = engine.last
        if last is None:
            return
        yield GaugeMetricFamily(
            "tokenfair_engine_kv_usage_ratio",
            "The engine's KV cache in use, as it last reported.",
            last.kv_usage_ratio,
        )
        requests = GaugeMetricFamily(
            "tokenfair_engine_requests",
            "Requests the engine last reported running or waiting.",
            labels=["state"],
        )
        for state, value in (("running", last.running), ("waiting", last.waiting)):
            if value is not None:
                requests.add_metric([state], value)
        yield requests
