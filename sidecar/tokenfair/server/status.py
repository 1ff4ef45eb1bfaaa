"""The ``/status`` document: config, books, per-tenant state and outcome counts.

``{"policy", "backend", "core", "config", "draining", "enforcement", "demand_ratio",
"max_in_flight", "time_scale", "books",
"kv", "fairness", "engine" (with an engine to read), "slots" (``tokenfair`` on a batching engine),
"tenants": {<tenant id>: {...}}, "budget_store": {..., "tenants": {...}}}`` (``budget_store``
only with a store). At 10,000 tenants the document is ~2 MB, so :func:`status_chunks` writes it
:data:`STATUS_CHUNK` tenants at a time for the admin handler to stream, yielding to the event
loop between chunks. Each tenant's entry is read at once (its queue, bucket and counts agree);
the books and the head are read first, so entries may be a few chunks newer than the books.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, Final

from tokenfair import native
from tokenfair.core.tokenfair import TokenfairScheduler
from tokenfair.server.metrics import LANE_NAMES
from tokenfair.server.sidecar import Sidecar

STATUS_CHUNK: Final = 100
"""Tenants' entries encoded between two yields to the event loop (~1 ms)."""


def status_head(sidecar: Sidecar) -> dict[str, object]:
    """Everything but the per-tenant entries."""
    books = sidecar.scheduler.books()
    engine = sidecar.engine
    connections = sidecar.connections
    config: dict[str, object] = {"version": sidecar.config.version, "sha256": sidecar.config_sha256}
    if sidecar.budget_store_notice:
        config["restart_needed"] = sidecar.budget_store_notice
    return {
        "policy": sidecar.policy_name,
        "backend": sidecar.backend.name,
        # which scheduling core this process runs (docs/native.md): "compiled" or
        # "interpreted", the same decisions either way
        "core": "compiled" if native.status().active else "interpreted",
        "config": config,
        "draining": sidecar.dispatcher.draining,
        # Shadow mode (docs/sidecar.md#shadow-mode): the policy's; a tenant may override it.
        "enforcement": sidecar.scheduler.policy.enforcement,
        # The scaling signal per lane (tokenfair_demand_ratio), now.
        "demand_ratio": {
            LANE_NAMES[lane]: round(ratio, 4) for lane, ratio in sidecar.demand_ratios().items()
        },
        "max_in_flight": sidecar.dispatcher.max_in_flight,
        "time_scale": sidecar.settings.time_scale,
        # The time base of the request records (model ms since the sidecar started), now: a
        # reader lines records up with other clocks by it.
        "clock_ms": round(sidecar.clock.now_ms(), 3),
        "books": {
            "queued_requests": books.queued_requests,
            "queued_service_tokens": books.queued_service_tokens,
            "queued_kv_blocks": books.queued_kv_blocks,
            "running_requests": books.running_requests,
            "resident_kv_blocks": books.resident_kv_blocks,
        },
        # The KV cache (server/kv_view.py): what the engine holds now as the sidecar sees it
        # (view), and what the gates see (the books corrected by the engine's last report, less
        # the running requests' decode credits with kvDecodeBooking: engine or peak,
        # `gate_blocks = resident + correction_blocks - gate_credit_blocks`; upfront: no
        # credit, the growth to their reservations counted in full); without a fresh
        # report ("source": "books", "engine" says why) the gates use the books alone. The
        # prompt ratio learned from the engine's usage, the one reservations are booked at
        # (kvPromptRatio), the engine's intake delay the view learned, and how running
        # requests' decode is booked (kvDecodeBooking; the allowance -1: in full).
        "kv": {
            "view_blocks": sidecar.kv_view.view_blocks(sidecar.scheduler),
            "gate_blocks": max(0, sidecar.scheduler.kv_gate_blocks),
            "correction_blocks": sidecar.scheduler.kv_correction_blocks,
            "gate_credit_blocks": sidecar.scheduler.kv_gate_credit_blocks,
            "prompt_ratio": round(sidecar.kv_view.prompt_ratio, 4),
            "gate_prompt_ratio": round(sidecar.scheduler.kv_prompt_ratio, 4),
            "intake_ms": round(sidecar.kv_view.intake_ms, 1),
            "decode_booking": sidecar.kv_view.decode_booking,
            "decode_allowance_tokens": sidecar.scheduler.kv_decode_allowance_tokens,
            "total_blocks": sidecar.scheduler.policy.total_kv_blocks,
            "block_tokens": sidecar.scheduler.policy.kv_block_tokens,
            "source": "engine" if engine is not None and engine.fresh else "books",
        },
        # The live fluid-reference fairness per lane (server/fairness_signal.py): its last
        # refresh, the same figures as the tokenfair_fluid_* metrics.
        "fairness": sidecar.fairness.status(),
        **({"engine": engine.status()} if engine is not None else {}),
        **({"connections": connections.status()} if connections is not None else {}),
        **slots_status(sidecar),
    }


def slots_status(sidecar: Sidecar) -> dict[str, object]:
    """``{"slots": {"engine", "batch", "batch_running"}}`` with the ``tokenfair`` policy on a
    batching engine (``maxBatchRequests`` above 1): the engine's slots, the most the batch lane
    may hold now (the interactive reserve: docs/capacity.md) and how many it holds; else empty."""
    scheduler = sidecar.scheduler
    batch = scheduler.policy.max_batch_requests
    if batch == 1 or not isinstance(scheduler, TokenfairScheduler):
        return {}
    return {
        "slots": {
            "engine": batch,
            "batch": scheduler.batch_slots(sidecar.clock.now_ms()),
            "batch_running": scheduler.batch_running,
        }
    }


def tenant_entry(sidecar: Sidecar, tenant_id: str, now_ms: float) -> Any:
    """One tenant's entry, from the core's read-only view of it (None: a tenant the core does
    not know; the core never forgets one, a reload only adds)."""
    view = sidecar.scheduler.tenant_view(tenant_id, now_ms)
    if view is None:
        return None
    budget = view.budget
    return {
        "priority_class": view.priority_class,
        "weight": view.weight,
        "queued_requests": view.queued_requests,
        "queued_service_tokens": view.queued_service_tokens,
        "served_service_tokens": view.served_service_tokens,
        "bucket_service_tokens": round(budget.level, 3),
        "burst_service_tokens": budget.burst,
        "counts": dict(sidecar.outcomes.tenant_counts.get(tenant_id, {})),
    }


def status_document(sidecar: Sidecar) -> dict[str, object]:
    """The whole document at once (tests and tools; the admin handler streams it)."""
    document: dict[str, object] = json.loads("".join(status_chunks(sidecar)))
    return document


def status_chunks(sidecar: Sidecar) -> Iterator[str]:
    """The document as JSON text, in chunks of at most :data:`STATUS_CHUNK` tenants."""
    yield json.dumps(status_head(sidecar))[:-1] + ', "tenants": '
    yield from mapping_chunks(_tenant_entries(sidecar))
    pool = sidecar.pool
    if pool is not None:
        head = pool.status_head()
        if sidecar.pool_fairness is not None:
            head["fairness"] = sidecar.pool_fairness.status()
        yield ', "budget_store": ' + json.dumps(head)[:-1] + ', "tenants": '
        yield from mapping_chunks(pool.tenant_statuses())
        yield "}"
    yield "}"


def _tenant_entries(sidecar: Sidecar) -> Iterator[tuple[str, object]]:
    tenants = sidecar.scheduler.tenant_ids()  # added during the scrape: the next one
    for start in range(0, len(tenants), STATUS_CHUNK):
        now_ms = sidecar.clock.now_ms()  # per chunk: the clock moves while the loop runs
        for tenant_id in tenants[start : start + STATUS_CHUNK]:
            yield tenant_id, tenant_entry(sidecar, tenant_id, now_ms)


def mapping_chunks(entries: Iterable[tuple[str, object]]) -> Iterator[str]:
    """A JSON object of ``entries``' pairs, encoded :data:`STATUS_CHUNK` pairs at a time (the
    pairs are read lazily: each chunk's as it is encoded)."""
    yield "{"
    first = True
    part: dict[str, object] = {}
    for name, value in entries:
        part[name] = value
        if len(part) == STATUS_CHUNK:
            yield ("" if first else ", ") + json.dumps(part)[1:-1]
            first, part = False, {}
    if part:
        yield ("" if first else ", ") + json.dumps(part)[1:-1]
    yield "}"
