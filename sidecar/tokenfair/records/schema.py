"""The record schemas: a request record (:class:`TraceLine`, its required part
:class:`TraceRequest`) and a decision record (:class:`RecordLine`), as msgspec structs
(docs/records.md). :mod:`tokenfair.records.codec` decodes, validates, words the errors and
encodes with them, and re-exports them.

A module of its own, without ``from __future__ import annotations``: msgspec reads a struct's
annotations to build its decoders and its schema, and a string annotation costs a
``typing.ForwardRef``, compiled from source, each time (~150 of them when ``records`` is
imported: a few milliseconds of every ``tokenfair simulate``'s start).
"""

from typing import Annotated, Final

import msgspec

from tokenfair.config import PriorityClass
from tokenfair.core import Request
from tokenfair.core.cost import MAX_REQUEST_TOKENS

MAX_RECORD_MS: Final = 1e15
"""The largest time a record may carry, in ms (about 31,700 years; a Unix timestamp in ms, ~1.8e12,
fits with room). Past ~1e16 ms a double no longer tells ``t`` from ``t + 1``, and the replay's
and the report's arithmetic break (a zero-length window); a record is refused first. At 1e15 a
double still resolves 0.125 ms."""

TokenCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_REQUEST_TOKENS)]
NonNegativeMs = Annotated[float, msgspec.Meta(ge=0, le=MAX_RECORD_MS)]
NonEmptyText = Annotated[str, msgspec.Meta(min_length=1)]


class TraceRequest(Request, forbid_unknown_fields=True, frozen=True, gc=False):
    """A request record's required fields with their rules (those of :class:`TraceLine`): a
    line that has no other key decodes straight into one (``records._REQUEST_LINE_DECODER``),
    validated, and it *is* a ``Request`` (a subclass), so the replay takes it as it is."""

    request_id: NonEmptyText
    tenant_id: NonEmptyText
    arrival_ms: NonNegativeMs
    prefill_tokens: TokenCount
    decode_tokens: TokenCount
    priority_class: PriorityClass


class TraceLine(TraceRequest, frozen=True, omit_defaults=True):
    """One request record as it is on the wire: **the** schema of a trace line (docs/records.md).

    Required fields (those of :class:`TraceRequest`) have no default; the observed ones default
    to ``None`` (absent and ``null`` mean the same). Integers must be JSON integers, booleans
    are not numbers, ``arrival_ms`` and the observed times are numbers >= 0 and at most
    :data:`MAX_RECORD_MS`. Decoded by ``records._DECODER``, which also accepts (and skips
    undecoded) the outcome fields of a decision record, so a sidecar's records replay as they
    are; any other key is an error. ``gc=False``
    (inherited): a record holds no containers, so the cyclic collector need not track it.
    """

    actual_prefill_tokens: TokenCount | None = None
    actual_decode_tokens: TokenCount | None = None
    ttft_ms: NonNegativeMs | None = None
    e2e_ms: NonNegativeMs | None = None


class RecordLine(msgspec.Struct, omit_defaults=True, gc=False):
    """A decision record line, **the** schema of one (docs/records.md): the fields of the core's
    ``Decision`` in its order, then the request fields a live record adds (the sidecar's and
    loadgen's; ``tokenfair simulate --records`` leaves them out). ``policy``, when given, is
    written before them by the encoder. ``gc=False``: ``observed`` is a dict of floats, never
    part of a cycle."""

    request_id: str
    tenant_id: str
    priority_class: str
    status_code: int
    reason: str
    gate: str
    service_tokens: int
    arrival_ms: float
    kv_occupancy_ratio: float
    queue_wait_ms: float
    ttft_ms: float
    dispatch_ms: float | None
    retry_after_ms: float | None
    actual_service_tokens: int | None
    observed: dict[str, float]
    would_refuse: bool = False
    prefill_tokens: int | None = None
    decode_tokens: int | None = None
    actual_prefill_tokens: int | None = None
    actual_decode_tokens: int | None = None
    e2e_ms: float | None = None
