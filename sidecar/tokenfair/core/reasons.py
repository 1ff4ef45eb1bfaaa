"""Every outcome reason, in one place: its wire value, the HTTP status the client gets, the gate
that produces it, the counter it is counted in, and what it means.

A reason is what a decision record's ``reason`` field, an access-log line's ``reason``, a
``429``'s ``tokenfair_reason``, a span's ``error.type`` and the ``reason``/``code`` label of
the refusal and backend-error counters say. :class:`Reason` is a :class:`~enum.StrEnum`: a
member *is* its wire value (``==``, hashing, ``str()``, f-strings, ``json`` and ``msgspec``
all give the plain string), so records are the same bytes whether a member or the string is
held.

Gates, in the order a request meets them (the core's three are the record's ``gate`` field):

* ``sidecar`` — the sidecar's own checks before admission (key, route, body, connections),
  and its own failures;
* ``admission``, ``queue``, ``dispatch`` — the core's gates (``core/jobs.py``,
  ``core/scheduler.py``); ``drain`` — a drain refuses at the door and empties the queue;
* ``upstream`` — the model server failed a dispatched request (the record keeps ``dispatch``);
* ``client`` — the client went away, or (``tokenfair loadgen``) never got an answer.

The docs' table of reasons (:func:`markdown_table`, in ``docs/records.md``) and of the label
values of the sidecar's reason-labelled counters (:func:`label_values_table`, in
``docs/sidecar.md``) are generated between markers: ``tokenfair reasons --write docs/records.md
docs/sidecar.md`` makes them anew, and a test fails when they differ.
The module stays interpreted (:data:`tokenfair.native.COMPILED` leaves it out): the compiled
core reads its members once, into ``Final`` constants, at import.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

GATES: Final = ("sidecar", "admission", "queue", "dispatch", "drain", "upstream", "client")
"""Where an outcome is decided, in the order a request meets them."""

COUNTERS: Final = {
    "admitted": "tokenfair_admitted_requests_total",
    "refused": "tokenfair_refused_requests_total{reason}",
    "cancelled": "tokenfair_cancelled_requests_total",
    "backend_errors": "tokenfair_backend_errors_total{code}",
    "invalid": "tokenfair_invalid_requests_total{status}",
    "connections": "tokenfair_refused_connections_total",
    "": "",
}
"""The sidecar counter each :attr:`Reason.counter` names (``""``: none of the sidecar's)."""


class Reason(StrEnum):
    """An outcome reason: the member's value is the wire string; ``status``, ``gates``,
    ``counter`` and ``meaning`` say the rest (:data:`GATES`, :data:`COUNTERS`)."""

    status: int
    """The HTTP status the client gets (``0``: no answer at all, loadgen's own reasons)."""
    gates: tuple[str, ...]
    """The gates that produce it (:data:`GATES`), the first the usual one."""
    counter: str
    """The key in :data:`COUNTERS` of the sidecar counter it is counted in."""
    meaning: str

    def __new__(
        cls, value: str, status: int, gates: tuple[str, ...], counter: str, meaning: str
    ) -> Reason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.status = status
        member.gates = gates
        member.counter = counter
        member.meaning = meaning
        return member

    def __repr__(self) -> str:
        """The wire string's own repr (``'shed_kv_watermark'``): a member prints as the string it
        replaced wherever a container of reasons is printed (the simulate report's shed tallies,
        log lines of an outcome), not as ``<Reason.X: '...'>``."""
        return str.__repr__(self)

    # -- the sidecar's checks, before admission ---------------------------------------------
    INVALID_JSON = (
        "invalid_json", 400, ("sidecar",), "invalid",
        "the body is not a JSON object, not UTF-8, or nests too deep",
    )  # fmt: skip
    INVALID_ENCODING = (
        "invalid_encoding", 400, ("sidecar",), "invalid",
        "the body does not decode as its `Content-Encoding` says",
    )  # fmt: skip
    BODY_TOO_COMPLEX = (
        "body_too_complex", 400, ("sidecar",), "invalid",
        "more than `maxJsonValues` JSON values, or nested deeper than `maxJsonDepth`",
    )  # fmt: skip
    INVALID_VALUE = (
        "invalid_value", 400, ("sidecar",), "invalid",
        "a field of the request is not valid (`param` names it)",
    )  # fmt: skip
    CONTEXT_LENGTH_EXCEEDED = (
        "context_length_exceeded", 400, ("sidecar",), "invalid",
        "the request asks for more tokens than the model's context holds",
    )  # fmt: skip
    INVALID_API_KEY = (
        "invalid_api_key", 401, ("sidecar",), "invalid",
        "no API key, or an unknown one",
    )  # fmt: skip
    NOT_FOUND = (
        "not_found", 404, ("sidecar",), "",
        "unknown route or method",
    )  # fmt: skip
    ROUTE_NOT_SERVED = (
        "route_not_served", 404, ("sidecar",), "invalid",
        "the engine does not serve this route (e.g. embeddings of a generative model)",
    )  # fmt: skip
    REQUEST_TIMEOUT = (
        "request_timeout", 408, ("sidecar",), "invalid",
        "the body took longer than `clientBodyTimeoutSeconds`",
    )  # fmt: skip
    REQUEST_TOO_LARGE = (
        "request_too_large", 413, ("sidecar",), "invalid",
        "the body is over `maxBodyBytes`, as sent or decoded",
    )  # fmt: skip
    UNSUPPORTED_CONTENT_ENCODING = (
        "unsupported_content_encoding", 415, ("sidecar",), "invalid",
        "a request `Content-Encoding` the sidecar does not decode",
    )  # fmt: skip
    EXPECTATION_FAILED = (
        "expectation_failed", 417, ("sidecar",), "invalid",
        "an `Expect` other than `100-continue`",
    )  # fmt: skip
    TOO_MANY_CONNECTIONS = (
        "too_many_connections", 503, ("sidecar",), "connections",
        "`maxClientConnections` reached, or the peer holds its share of unauthenticated ones",
    )  # fmt: skip

    # -- the core's gates -------------------------------------------------------------------
    REQUEST_OVER_KV_CAPACITY = (
        "request_over_kv_capacity", 400, ("admission",), "refused",
        "never admissible: its own KV blocks are above its class's watermark of the cache",
    )  # fmt: skip
    REQUEST_OVER_TENANT_KV_SHARE = (
        "request_over_tenant_kv_share", 400, ("admission",), "refused",
        "never admissible: its own KV blocks are above its tenant's `maxKvShare` of the pool",
    )  # fmt: skip
    REQUEST_OVER_TENANT_BURST = (
        "request_over_tenant_burst", 400, ("admission",), "refused",
        "never admissible: its cost is above the tenant's `burstServiceTokens` (no lending)",
    )  # fmt: skip
    SHED_KV_WATERMARK = (
        "shed_kv_watermark", 429, ("admission", "dispatch"), "refused",
        "KV occupancy would pass the class watermark",
    )  # fmt: skip
    SHED_QUEUE_WAIT_SLO = (
        "shed_queue_wait_slo", 429, ("admission",), "refused",
        "predicted queue wait above the class limit",
    )  # fmt: skip
    SHED_TENANT_TOKEN_QUOTA = (
        "shed_tenant_token_quota", 429, ("admission",), "refused",
        "the tenant's token budget cannot cover it within the class wait limit",
    )  # fmt: skip
    QUEUE_FULL = (
        "queue_full", 429, ("admission",), "refused",
        "a queue bound (all tenants, or this tenant)",
    )  # fmt: skip
    SHED_QUEUE_TIMEOUT = (
        "shed_queue_timeout", 429, ("queue",), "refused",
        "waited in the queue past the class limit",
    )  # fmt: skip
    SHED_TENANT_CONCURRENCY = (
        "shed_tenant_concurrency", 429, ("queue",), "refused",
        "waited past the class limit, held at the end by its tenant's `maxConcurrentRequests`",
    )  # fmt: skip
    SHED_TENANT_KV_SHARE = (
        "shed_tenant_kv_share", 429, ("queue", "admission"), "refused",
        "waited past the class limit, held at the end by its tenant's `maxKvShare` (admission:"
        " the request alone is above that share)",
    )  # fmt: skip
    CANCELLED = (
        "cancelled", 499, ("queue", "client"), "cancelled",
        "the client went away (before dispatch, or during the answer)",
    )  # fmt: skip
    ADMITTED = (
        "admitted", 200, ("dispatch",), "admitted",
        "dispatched to the backend (the status is the upstream's answer)",
    )  # fmt: skip
    DRAINING = (
        "draining", 503, ("drain",), "refused",
        "the sidecar is shutting down: refused at the door, or taken out of the queue",
    )  # fmt: skip
    DRAIN_ABORTED = (
        "drain_aborted", 503, ("drain",), "backend_errors",
        "still running when the drain grace ran out, nothing of its answer sent: cut",
    )  # fmt: skip

    # -- after dispatch ---------------------------------------------------------------------
    INTERNAL_ERROR = (
        "internal_error", 500, ("sidecar",), "backend_errors",
        "the sidecar itself failed on the request (a bug, logged with its traceback)",
    )  # fmt: skip
    UPSTREAM_ERROR = (
        "upstream_error", 502, ("upstream",), "backend_errors",
        "the upstream refused, reset, or broke before responding",
    )  # fmt: skip
    UPSTREAM_UNAVAILABLE = (
        "upstream_unavailable", 502, ("upstream",), "backend_errors",
        "the upstream client is closed (the sidecar is stopping)",
    )  # fmt: skip
    UPSTREAM_TOO_LARGE = (
        "upstream_too_large", 502, ("upstream",), "backend_errors",
        "the upstream's head, trailers or non-streamed body passed the relay's bounds",
    )  # fmt: skip
    UPSTREAM_ABORTED = (
        "upstream_aborted", 502, ("upstream",), "backend_errors",
        "the upstream broke a stream after its 200 (the client saw an incomplete transfer)",
    )  # fmt: skip
    UPSTREAM_TIMEOUT = (
        "upstream_timeout", 504, ("upstream",), "backend_errors",
        "upstream connect or read timeout",
    )  # fmt: skip
    UPSTREAM_BAD_USAGE = (
        "upstream_bad_usage", 200, ("upstream",), "backend_errors",
        "served, but the reported usage was not believed: settled at the estimate or the bound",
    )  # fmt: skip
    CLIENT_WRITE_TIMEOUT = (
        "client_write_timeout", 499, ("client",), "cancelled",
        "the client stopped reading a stream for `clientWriteTimeoutSeconds` and was cut",
    )  # fmt: skip

    # -- tokenfair loadgen's own (no answer reached the client) -----------------------------
    CLIENT_TIMEOUT = (
        "client_timeout", 0, ("client",), "",
        "loadgen: the request (or the run) timed out before the response was complete",
    )  # fmt: skip
    CONNECTION_ERROR = (
        "connection_error", 0, ("client",), "",
        "loadgen: the connection failed or broke (refused, reset, malformed HTTP)",
    )  # fmt: skip
    NOT_SENT = (
        "not_sent", 0, ("client",), "",
        "loadgen: the run's timeout passed before the request's send time",
    )  # fmt: skip


def reasons_counted_in(counter: str) -> tuple[Reason, ...]:
    """The reasons counted in ``counter`` (a key of :data:`COUNTERS`), in declaration order:
    the label values of ``tokenfair_refused_requests_total{reason}`` for ``refused``."""
    if counter not in COUNTERS:
        raise ValueError(f"counter: {counter!r} is not one of {sorted(COUNTERS)}")
    return tuple(reason for reason in Reason if reason.counter == counter)


def markdown_table() -> str:
    """The docs' table of reasons (newline-terminated): one row per member, in order."""
    rows = [
        "| reason | status | gate | counted in | meaning |",
        "|--------|--------|------|------------|---------|",
    ]
    for reason in Reason:
        status = str(reason.status) if reason.status else "— (none)"
        gates = " / ".join(reason.gates)
        rows.append(
            f"| `{reason.value}` | {status} | {gates} | {_code(COUNTERS[reason.counter])} "
            f"| {reason.meaning} |"
        )
    return "\n".join(rows) + "\n"


def label_values_table() -> str:
    """The docs' table of the label values the sidecar's reason-labelled counters take
    (newline-terminated): ``tokenfair_refused_requests_total{reason}``,
    ``tokenfair_backend_errors_total{code}`` and the statuses of
    ``tokenfair_invalid_requests_total{status}``, from :attr:`Reason.counter`."""
    rows = ["| counter | label values |", "|---------|--------------|"]
    for counter in ("refused", "backend_errors"):
        values = ", ".join(f"`{reason.value}`" for reason in reasons_counted_in(counter))
        if counter == "backend_errors":
            values += " (and `admitted`: an upstream's own 5xx answer)"
        rows.append(f"| {_code(COUNTERS[counter])} | {values} |")
    statuses = sorted({reason.status for reason in reasons_counted_in("invalid")})
    rows.append(f"| {_code(COUNTERS['invalid'])} | {', '.join(map(str, statuses))} |")
    return "\n".join(rows) + "\n"


def _code(text: str) -> str:
    return f"`{text}`" if text else "—"


BLOCKS: Final = {"reasons": markdown_table, "label-values": label_values_table}
"""The generated blocks of the docs by name (``docs/records.md`` holds ``reasons``,
``docs/sidecar.md`` ``label-values``)."""


def begin_marker(name: str) -> str:
    return f"<!-- generated by `tokenfair reasons --write`: {name} -->"


def end_marker(name: str) -> str:
    return f"<!-- end of generated: {name} -->"


def update(text: str) -> str:
    """``text`` with every generated block between its markers made anew (a block whose end
    marker is missing is an error naming it); text without markers is returned as it is."""
    for name, render in BLOCKS.items():
        begin, end = begin_marker(name), end_marker(name)
        start = text.find(begin)
        while start >= 0:
            body = start + len(begin) + 1
            stop = text.find(end, body)
            if stop < 0:
                raise ValueError(f"{name}: {begin!r} has no {end!r} after it")
            text = text[:body] + render() + text[stop:]
            start = text.find(begin, body)
    return text
