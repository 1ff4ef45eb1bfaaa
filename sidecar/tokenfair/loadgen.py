"""Replay a workload against a live OpenAI-compatible endpoint, on the workload's own timeline.

Timeline (open loop): request ``i`` is sent at ``start + arrival_ms * time_scale`` (wall clock),
never earlier, whatever happened to earlier requests (requests due at the same instant leave
together, in no promised order). ``time_scale`` < 1
runs faster than the trace (0.1 = ten times faster). Requests waiting for a free connection
(``concurrency_limit``) are late, and that lateness counts in their TTFT.

Each request is one ``POST {target}/v1/completions`` with ``Authorization: Bearer <tenant key>``,
``x-request-id: <request_id>``, ``x-tokenfair-priority: batch`` for batch records, a prompt of
``prefill_tokens * CHARS_PER_TOKEN`` characters and ``max_tokens = max(1, decode_tokens)``.

Measured per request, in wall milliseconds from the request's *scheduled* send time:

* ``ttft``: the first SSE ``data:`` event when streaming, else the whole response;
* ``e2e``: the end of the response body;
* from the response: status, the JSON error ``code`` of a refusal, ``Retry-After`` (seconds),
  the sidecar's queue wait (header :data:`QUEUE_WAIT_HEADER`, ms) and the ``usage`` block
  (the final streamed chunk when streaming; ``stream_options.include_usage`` is asked for).

:func:`to_decision` turns an observation into the simulator's :class:`Decision`, with every time
divided by ``time_scale`` (wall -> model time), so ``report.summarize`` reads live runs and
simulated runs alike. Outcomes without an HTTP response have ``status_code`` 0 and a reason of
:data:`CLIENT_TIMEOUT`, :data:`CONNECTION_ERROR` or :data:`NOT_SENT`.

Bounds: every request has ``request_timeout_s`` (total, wall); the whole run has ``timeout_s``,
after which in-flight requests are cancelled (:data:`CLIENT_TIMEOUT`) and unsent ones are
recorded as :data:`NOT_SENT`.

KV occupancy cannot be seen from the client. With ``admin_url`` (the sidecar's admin listener)
the run samples the sidecar's ``/metrics`` gauge :data:`KV_GAUGE` (reserved KV blocks over the
total, what a decision's ``kv_occupancy_ratio`` is right after its dispatch) every
``kv_sample_s`` on a connection of its own, and :class:`ReplayResult` carries the largest value
seen: a sampled peak, so a lower bound of the true one (a spike between two samples is missed).
Without it there is no live KV figure (``None``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from yarl import URL

from tokenfair.config import PolicyConfig
from tokenfair.core import Decision, Request
from tokenfair.core.cost import CostModel
from tokenfair.core.jobs import (
    ADMITTED,
    SHED_QUEUE_TIMEOUT,
    SHED_TENANT_CONCURRENCY,
    SHED_TENANT_KV_SHARE,
    STATUS_OK,
    STATUS_SHED,
)
from tokenfair.core.reasons import Reason
from tokenfair.records.codec import RecordLine, decision_line

_QUEUE_REASONS: Final = frozenset(
    {SHED_QUEUE_TIMEOUT, SHED_TENANT_CONCURRENCY, SHED_TENANT_KV_SHARE}
)
"""Reasons of a sidecar's 429 from the queue (a request over its tenant's KV share from the
start is a 400, so ``shed_tenant_kv_share`` comes from the queue)."""
CHARS_PER_TOKEN: Final = 4
"""Prompt characters per prompt token: the rule the sidecar's default estimator uses
(``ceil(len(prompt) / 4)``, OpenAI's rule of thumb for English text). The one place it lives
on the load generator's side."""
PROMPT_UNIT: Final = "tok "
"""Repeated to build prompts: exactly ``CHARS_PER_TOKEN`` characters (and one real BPE token)."""
COMPLETIONS_PATH: Final = "/v1/completions"
QUEUE_WAIT_HEADER: Final = "x-tokenfair-queue-wait-ms"
"""Response header in which the sidecar reports how long the request queued (wall ms)."""
REQUEST_ID_HEADER: Final = "x-request-id"
PRIORITY_HEADER: Final = "x-tokenfair-priority"
"""Sent as ``batch`` for batch records: a tenant may lower its class, never raise it, so
interactive records rely on the tenant's own class."""

CLIENT_TIMEOUT: Final = Reason.CLIENT_TIMEOUT
"""The request (or the run) timed out before the response was complete."""
CONNECTION_ERROR: Final = Reason.CONNECTION_ERROR
"""The connection failed or broke (refused, reset, malformed HTTP)."""
NOT_SENT: Final = Reason.NOT_SENT
"""The run's timeout passed before the request's send time."""
STATUS_NO_RESPONSE: Final = 0
KV_GAUGE: Final = "tokenfair_kv_occupancy_ratio"
"""The sidecar's gauge of reserved KV blocks over total KV blocks (admin ``/metrics``)."""
METRICS_PATH: Final = "/metrics"
MODELS_PATH: Final = "/v1/models"
FALLBACK_MODEL: Final = "tokenfair-costmodel"
"""The model sent when ``--model`` is not given and the target lists none (the name the
sidecar's cost-model engine serves by default)."""
log = logging.getLogger("tokenfair.loadgen")


class NoModelError(ValueError):
    """The target listed no model to send (and ``--model`` was not given): the message says
    why and names the flag."""


async def first_model(
    session: aiohttp.ClientSession, settings: LoadgenSettings, api_key: str
) -> str:
    """The first model ``GET /v1/models`` of the target lists (the sidecar relays its engine's
    list, or names its cost-model engine's); :class:`NoModelError` saying why otherwise."""
    base = settings.completions_url
    url = base.with_path(base.path[: -len(COMPLETIONS_PATH)].rstrip("/") + MODELS_PATH)
    try:
        async with session.get(
            url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=aiohttp.ClientTimeout(total=settings.request_timeout_s),
        ) as response:
            if response.status != 200:
                raise NoModelError(f"--model not given and GET {url} answered "
                                   f"HTTP {response.status}: pass --model NAME")  # fmt: skip
            listing = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        raise NoModelError(f"--model not given and GET {url} failed ({type(exc).__name__}: "
                           f"{exc}): pass --model NAME") from None  # fmt: skip
    entries = listing.get("data") if isinstance(listing, dict) else None
    for entry in entries if isinstance(entries, list) else ():
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and entry["id"]:
            return str(entry["id"])
    raise NoModelError(f"--model not given and GET {url} lists no model: pass --model NAME")


def prompt_for(prefill_tokens: int) -> str:
    """A prompt the sidecar's estimator sizes at exactly ``prefill_tokens`` tokens."""
    return PROMPT_UNIT * prefill_tokens


@dataclass(frozen=True, slots=True)
class LoadgenSettings:
    """How to replay. Times are wall seconds unless the name says otherwise."""

    target_url: str
    """Base URL of the endpoint (``http://127.0.0.1:8080``); a URL already ending in
    ``/v1/completions`` is used as is."""
    time_scale: float = 1.0
    """Wall time per unit of trace time (> 0); 0.1 replays ten times faster."""
    stream: bool = False
    """Ask for SSE streaming (TTFT = first chunk) instead of one JSON response."""
    concurrency_limit: int = 256
    """Most requests in flight at once (and connections in the pool)."""
    timeout_s: float = 300.0
    """Bound on the whole run, from its start."""
    request_timeout_s: float = 30.0
    """Bound on one request, from when it is sent to the end of its body."""
    model: str | None = None
    """``model`` field of every request body; None: the first model the target lists
    (``GET /v1/models`` with the first tenant's key, :func:`first_model`), as a real engine
    answers a model it does not serve ``404`` (a target that lists none: a warning, and
    :data:`FALLBACK_MODEL`)."""
    decode_weight: float = PolicyConfig().decode_weight
    """Converts tokens to service tokens for the report (the sidecar's ``decodeWeight``; the
    default is the policy's)."""
    admin_url: str | None = None
    """Base URL of the sidecar's admin listener (``http://127.0.0.1:9090``): its ``/metrics``
    is sampled for the KV occupancy during the run. None: KV is not measured."""
    kv_sample_s: float = 0.05
    """Wall seconds between two samples of the KV gauge."""

    @property
    def metrics_url(self) -> URL | None:
        if self.admin_url is None:
            return None
        base = URL(self.admin_url)
        if base.path.rstrip("/").endswith(METRICS_PATH):
            return base
        return base.with_path(base.path.rstrip("/") + METRICS_PATH)

    @property
    def completions_url(self) -> URL:
        base = URL(self.target_url)
        if base.path.rstrip("/").endswith(COMPLETIONS_PATH):
            return base
        return base.with_path(base.path.rstrip("/") + COMPLETIONS_PATH)


@dataclass(slots=True)
class Observation:
    """What the client saw of one request. Offsets are wall ms from the run's start."""

    request: Request
    scheduled_offset_ms: float
    sent_offset_ms: float | None = None
    status_code: int = STATUS_NO_RESPONSE
    reason: str = NOT_SENT
    ttft_wall_ms: float | None = None
    e2e_wall_ms: float | None = None
    queue_wait_wall_ms: float | None = None
    retry_after_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str = ""


@dataclass(slots=True)
class KvSamples:
    """The sidecar's KV gauge as sampled during a run."""

    peak: float | None = None
    """The largest value read; None before a first successful sample."""
    samples: int = 0
    error: str = ""
    """Why sampling stopped early (the first failed scrape), else empty."""

    def add(self, value: float) -> None:
        self.samples += 1
        if self.peak is None or value > self.peak:
            self.peak = value


@dataclass(slots=True)
class ReplayResult:
    observations: list[Observation]
    wall_s: float
    completed: bool
    """False when the run's ``timeout_s`` cut it short."""
    settings: LoadgenSettings = field(repr=False)
    kv: KvSamples | None = None
    """The sampled KV occupancy (``settings.admin_url`` given), else None."""


def gauge_value(text: str, name: str) -> float | None:
    """The value of the unlabelled sample ``name`` in Prometheus text, or None if absent."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name) :]
        if rest.startswith("{"):
            rest = rest.partition("}")[2]
        elif not rest.startswith(" "):
            continue  # a longer name with this prefix
        fields = rest.split()
        if fields:
            try:
                return float(fields[0])
            except ValueError:
                return None
    return None


async def sample_kv(settings: LoadgenSettings, kv: KvSamples, stop: asyncio.Event) -> None:
    """Read the KV gauge every ``settings.kv_sample_s`` until ``stop`` is set (one last read
    then) or a scrape fails (``kv.error`` says why)."""
    url = settings.metrics_url
    assert url is not None
    timeout = aiohttp.ClientTimeout(total=max(1.0, settings.kv_sample_s * 20))
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        while True:
            last = stop.is_set()
            try:
                async with session.get(url) as response:
                    text = await response.text()
                    if response.status != STATUS_OK:
                        kv.error = f"{url}: HTTP {response.status}"
                        return
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                kv.error = f"{url}: {type(exc).__name__}: {exc}"
                return
            value = gauge_value(text, KV_GAUGE)
            if value is None:
                kv.error = f"{url}: no {KV_GAUGE} sample (not a tokenfair sidecar's admin port?)"
                return
            kv.add(value)
            if last:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.kv_sample_s)


def _body(request: Request, settings: LoadgenSettings) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": settings.model,
        "prompt": prompt_for(request.prefill_tokens),
        # OpenAI-compatible servers (the sidecar too) refuse max_tokens < 1.
        "max_tokens": max(1, request.decode_tokens),
    }
    if settings.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _number_header(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None  # an HTTP-date Retry-After or garbage: not a number of seconds
    return value if value >= 0 else None


def _read_usage(observation: Observation, payload: object) -> None:
    if not isinstance(payload, dict):
        return
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return
    for key, attr in (
        ("prompt_tokens", "prompt_tokens"),
        ("completion_tokens", "completion_tokens"),
    ):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            setattr(observation, attr, value)


def _error_code(payload: object, status: int) -> str:
    """The sidecar's reason: ``error.tokenfair_reason`` (a 429 carries OpenAI's
    ``rate_limit_exceeded`` in ``code`` and the gate's reason there), else the OpenAI-style
    ``error.code``, else ``http_<status>``."""
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            for field in ("tokenfair_reason", "code"):
                code = error.get(field)
                if isinstance(code, str) and code:
                    return code
    return f"http_{status}"


class _Run:
    """One replay: the session, the clock and the observations (in send order)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        settings: LoadgenSettings,
        keys: Mapping[str, str],
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self.session = session
        self.settings = settings
        self.keys = keys
        self.on_done = on_done
        self.url = settings.completions_url
        self.slots = asyncio.Semaphore(settings.concurrency_limit)
        self.start = time.monotonic()

    def offset_ms(self) -> float:
        return (time.monotonic() - self.start) * 1000.0

    async def send(self, observation: Observation) -> None:
        # asyncio may fire a timer up to one clock tick early; loop until the send time is reached
        # so no request ever leaves before its place on the timeline.
        while (delay_ms := observation.scheduled_offset_ms - self.offset_ms()) > 0:
            await asyncio.sleep(delay_ms / 1000.0)
        async with self.slots:
            observation.sent_offset_ms = self.offset_ms()
            try:
                await self._exchange(observation)
            except TimeoutError:
                observation.status_code = STATUS_NO_RESPONSE
                observation.reason = CLIENT_TIMEOUT
            except (aiohttp.ClientError, ValueError) as exc:
                observation.status_code = STATUS_NO_RESPONSE
                observation.reason = CONNECTION_ERROR
                observation.error = f"{type(exc).__name__}: {exc}"
        if self.on_done is not None:
            self.on_done()

    async def _exchange(self, observation: Observation) -> None:
        request = observation.request
        headers = {
            "Authorization": f"Bearer {self.keys[request.tenant_id]}",
            REQUEST_ID_HEADER: request.request_id,
        }
        if request.priority_class == "batch":
            headers[PRIORITY_HEADER] = "batch"
        timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout_s)
        async with self.session.post(
            self.url, json=_body(request, self.settings), headers=headers, timeout=timeout
        ) as response:
            observation.queue_wait_wall_ms = _number_header(response.headers, QUEUE_WAIT_HEADER)
            observation.retry_after_s = _number_header(response.headers, "Retry-After")
            if response.status == STATUS_OK and self.settings.stream:
                await self._read_stream(observation, response)
            else:
                raw = await response.read()
                observation.ttft_wall_ms = self.since_scheduled(observation)
                try:
                    payload: object = json.loads(raw) if raw else None
                except ValueError:
                    payload = None
                if response.status == STATUS_OK:
                    _read_usage(observation, payload)
                else:
                    observation.reason = _error_code(payload, response.status)
            observation.e2e_wall_ms = self.since_scheduled(observation)
            observation.status_code = response.status
            if response.status == STATUS_OK:
                observation.reason = ADMITTED

    async def _read_stream(
        self, observation: Observation, response: aiohttp.ClientResponse
    ) -> None:
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, `event:` lines
            data = line[5:].strip()
            if observation.ttft_wall_ms is None:
                observation.ttft_wall_ms = self.since_scheduled(observation)
            if data == b"[DONE]":
                break
            # Only the usage chunk (normally the last) is decoded; text chunks are just counted.
            if b'"usage"' in data:
                with contextlib.suppress(ValueError):
                    _read_usage(observation, json.loads(data))

    def since_scheduled(self, observation: Observation) -> float:
        return self.offset_ms() - observation.scheduled_offset_ms


def order(requests: Iterable[Request]) -> list[Request]:
    """Schedule order: by arrival, ties by request id (the simulator's order)."""
    return sorted(requests, key=lambda r: (r.arrival_ms, r.request_id))


async def replay(
    requests: Sequence[Request],
    keys: Mapping[str, str],
    settings: LoadgenSettings,
    on_done: Callable[[], None] | None = None,
) -> ReplayResult:
    """Send every request on its timeline; returns one observation per request, in send order.

    ``keys`` maps every tenant of ``requests`` to its API key (a missing one is a ``KeyError``
    before anything is sent). ``on_done`` is called each time a request has its outcome (the
    CLI's progress bar). With ``settings.admin_url`` the KV gauge is sampled meanwhile.
    """
    missing = sorted({r.tenant_id for r in requests} - set(keys))
    if missing:
        raise KeyError(f"no API key for tenant(s) {', '.join(missing)}")
    kv = None if settings.admin_url is None else KvSamples()
    stop = asyncio.Event()
    sampler = None if kv is None else asyncio.create_task(sample_kv(settings, kv, stop))
    try:
        result = await _replay(requests, keys, settings, on_done)
    finally:
        stop.set()
        if sampler is not None:
            await sampler
    result.kv = kv
    return result


async def _replay(
    requests: Sequence[Request],
    keys: Mapping[str, str],
    settings: LoadgenSettings,
    on_done: Callable[[], None] | None,
) -> ReplayResult:
    connector = aiohttp.TCPConnector(limit=settings.concurrency_limit)
    async with aiohttp.ClientSession(connector=connector) as session:
        if settings.model is None and requests:
            first_key = keys[min(r.tenant_id for r in requests)]
            try:
                model = await first_model(session, settings, first_key)
            except NoModelError as exc:
                log.warning("%s; sending model %r", exc, FALLBACK_MODEL)
                model = FALLBACK_MODEL
            settings = dataclasses.replace(settings, model=model)
        run = _Run(session, settings, keys, on_done)
        observations = [
            Observation(r, scheduled_offset_ms=r.arrival_ms * settings.time_scale)
            for r in order(requests)
        ]
        tasks = [asyncio.create_task(run.send(o)) for o in observations]
        completed = True
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=settings.timeout_s)
            if pending:
                completed = False
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                for task, observation in zip(tasks, observations, strict=True):
                    # Cut short by the run's timeout: in flight -> timed out; unsent stays so.
                    if task in pending and observation.sent_offset_ms is not None:
                        observation.status_code = STATUS_NO_RESPONSE
                        observation.reason = CLIENT_TIMEOUT
        wall_s = time.monotonic() - run.start
    return ReplayResult(observations, wall_s, completed, settings)


def to_decision(observation: Observation, settings: LoadgenSettings) -> Decision:
    """The observation as a simulator decision record, times in model ms (wall / time_scale).

    ``service_tokens`` is the request's estimate (``prefill + ceil(decode_weight * decode)``);
    ``actual_service_tokens`` comes from the ``usage`` block when the response had one.
    """
    request = observation.request
    scale = settings.time_scale
    cost = CostModel(decode_weight=settings.decode_weight)

    def model_ms(wall_ms: float | None) -> float | None:
        return None if wall_ms is None else round(wall_ms / scale, 3)

    actual: int | None = None
    if observation.prompt_tokens is not None or observation.completion_tokens is not None:
        actual = cost.service_tokens(
            request.prefill_tokens
            if observation.prompt_tokens is None
            else observation.prompt_tokens,
            request.decode_tokens
            if observation.completion_tokens is None
            else observation.completion_tokens,
        )
    if observation.status_code == STATUS_OK:
        gate = "dispatch"
    elif observation.status_code == STATUS_NO_RESPONSE:
        gate = "client"
    elif observation.reason in _QUEUE_REASONS:
        gate = "queue"
    elif observation.status_code == STATUS_SHED:
        gate = "admission"
    else:
        gate = "http"
    observed: dict[str, float] = {}
    if observation.sent_offset_ms is not None:
        observed["send_lag_ms"] = round(
            (observation.sent_offset_ms - observation.scheduled_offset_ms) / scale, 3
        )
    if observation.e2e_wall_ms is not None:
        observed["e2e_ms"] = round(observation.e2e_wall_ms / scale, 3)
    retry_after_ms = None
    if observation.retry_after_s is not None:
        retry_after_ms = round(observation.retry_after_s * 1000.0 / scale, 3)
    return Decision(
        request_id=request.request_id,
        tenant_id=request.tenant_id,
        priority_class=request.priority_class,
        status_code=observation.status_code,
        reason=observation.reason,
        gate=gate,
        service_tokens=cost.service_tokens(request.prefill_tokens, request.decode_tokens),
        arrival_ms=request.arrival_ms,
        queue_wait_ms=model_ms(observation.queue_wait_wall_ms) or 0.0,
        ttft_ms=model_ms(observation.ttft_wall_ms) or 0.0,
        retry_after_ms=retry_after_ms,
        actual_service_tokens=actual,
        observed=observed,
    )


def record_line(observation: Observation, decision: Decision) -> RecordLine:
    """One line of ``--records``: the decision's outcome fields plus the request in trace format
    (the sidecar's record line, see ``records/codec.py``), so ``tokenfair simulate --trace`` can
    replay a live run; ``e2e_ms`` is the decision's ``observed["e2e_ms"]`` when there is one."""
    request = observation.request
    return decision_line(
        decision, None, None, None, request.prefill_tokens, request.decode_tokens,
        observation.prompt_tokens, observation.completion_tokens, decision.observed.get("e2e_ms"),
    )  # fmt: skip
