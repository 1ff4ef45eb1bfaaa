"""The sidecar's cheap per-request bookkeeping against the libraries it replaces on the hot path.

* Metrics: the per-request series are plain numbers rendered at scrape time; what ``/metrics``
  shows must be what ``prometheus_client``'s own Counter and Histogram show for the same updates
  (same names, labels, cumulative buckets with inclusive bounds, sum and count).
* Request records: ``encode_record`` writes the JSON text directly; it must equal ``json``'s
  encoding of ``request_record`` byte for byte, whatever the values (non-finite numbers, None,
  non-ASCII names, names containing ``inf``/``nan``).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from sidecar_support import keyed_config

from tokenfair.config import PriorityClass
from tokenfair.core import DEFAULT_POLICY, Decision, Request, make_scheduler
from tokenfair.core.reasons import Reason
from tokenfair.records.live import Usage, encode_record, request_record
from tokenfair.server.metrics import E2E_BUCKETS_S, LATENCY_BUCKETS_S, Metrics

# Bounds themselves (a value equal to ``le`` counts in that bucket), between them, 0, past the
# last bound (+Inf only).
VALUES_S = [0.0, 0.005, 0.0051, 0.01, 0.3, 1.0, 2.5, 29.9, 30.0, 31.0, 1e6]


def _samples(text: str, prefix: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith(prefix))


def test_series_render_like_prometheus_client() -> None:
    config = keyed_config()
    scheduler = make_scheduler(DEFAULT_POLICY, config, 0.0)
    ours = Metrics(lambda: (scheduler, False, config.version, ""))
    reference = CollectorRegistry()
    wait = Histogram(
        "tokenfair_queue_wait_seconds", "Time from arrival to dispatch.", ["tenant", "lane"],
        buckets=LATENCY_BUCKETS_S, registry=reference,
    )  # fmt: skip
    ttft = Histogram(
        "tokenfair_ttft_seconds", "Time from arrival to the first response byte.", ["lane"],
        buckets=LATENCY_BUCKETS_S, registry=reference,
    )  # fmt: skip
    admitted = Counter(
        "tokenfair_admitted_requests", "Requests dispatched.", ["tenant", "lane"],
        registry=reference,
    )  # fmt: skip
    tenant_ttft = Histogram(
        "tokenfair_time_to_first_token_seconds", "Time from arrival to the first response byte.",
        ["tenant", "lane"], buckets=LATENCY_BUCKETS_S, registry=reference,
    )  # fmt: skip
    e2e = Histogram(
        "tokenfair_e2e_request_latency_seconds",
        "Time from arrival to the end of the answer, for requests that ran.",
        ["tenant", "lane"], buckets=E2E_BUCKETS_S, registry=reference,
    )  # fmt: skip
    prompt = Counter(
        "tokenfair_prompt_tokens",
        "Prompt tokens the backend reported (usage.prompt_tokens) for requests that ran.",
        ["tenant", "lane"], registry=reference,
    )  # fmt: skip
    refused = Counter(
        "tokenfair_refused_requests", "Requests refused, by reason.",
        ["tenant", "lane", "reason"], registry=reference,
    )  # fmt: skip
    errors = Counter(
        "tokenfair_backend_errors", "Requests the backend failed.",
        ["tenant", "lane", "code"], registry=reference,
    )  # fmt: skip
    # A tenant id is any non-empty string: the label text escapes it as prometheus_client does.
    odd = 'we"ird\\te\nnant'
    for tenant, lane in (("a", "interactive"), ("b", "batch"), ("a", "batch"), (odd, "batch")):
        series = ours.lane_series(tenant, lane)
        for value in VALUES_S:
            series.queue_wait.observe(value)
            series.observe_ttft(value * 2)
            series.e2e.observe(value * 30)
            series.admitted += 1
            series.prompt_tokens += 7
            wait.labels(tenant, lane).observe(value)
            ttft.labels(lane).observe(value * 2)
            tenant_ttft.labels(tenant, lane).observe(value * 2)
            e2e.labels(tenant, lane).observe(value * 30)
            admitted.labels(tenant, lane).inc()
            prompt.labels(tenant, lane).inc(7)
        if tenant != "b":
            for reason in ("queue_full", "shed_queue_wait_slo", "queue_full"):
                series.count_refused(reason)
                refused.labels(tenant, lane, reason).inc()
            series.count_backend_error("upstream_error")
            errors.labels(tenant, lane, "upstream_error").inc()
    series = ours.lane_series("b", "batch")
    series.admitted += 2_500_000  # past a million: Go's exponent form (2.500011e+06)
    admitted.labels("b", "batch").inc(2_500_000)
    assert ours.lane_series("a", "batch") is ours.lane_series("a", "batch")
    ours_text = ours.render()
    reference_text = generate_latest(reference).decode()

    # Every line the reference writes, ours writes (a _created stamp's value aside; the
    # histograms carry none, as before).
    def without_created_values(text: str) -> list[str]:
        return [
            line.rpartition(" ")[0] if "_created{" in line else line
            for line in text.splitlines()
            if "_seconds_created" not in line
        ]

    ours_lines = without_created_values(ours_text)
    for line in without_created_values(reference_text):
        assert line in ours_lines, line
    for prefix in (
        "tokenfair_queue_wait_seconds_bucket",
        "tokenfair_queue_wait_seconds_count",
        "tokenfair_queue_wait_seconds_sum",
        "tokenfair_ttft_seconds_bucket",
        "tokenfair_ttft_seconds_count",
        "tokenfair_ttft_seconds_sum",
        "tokenfair_admitted_requests_total",
        *(f"tokenfair_time_to_first_token_seconds_{s}" for s in ("bucket", "count", "sum")),
        *(f"tokenfair_e2e_request_latency_seconds_{s}" for s in ("bucket", "count", "sum")),
        "tokenfair_prompt_tokens_total",
        "tokenfair_refused_requests_total",
        "tokenfair_backend_errors_total",
        "# HELP tokenfair_refused_requests_created ",
        "# TYPE tokenfair_refused_requests_created ",
        "# HELP tokenfair_e2e_request_latency_seconds ",
        "# HELP tokenfair_prompt_tokens_total ",
        "# HELP tokenfair_queue_wait_seconds ",
        "# TYPE tokenfair_queue_wait_seconds ",
        "# HELP tokenfair_admitted_requests_total ",
        "# TYPE tokenfair_admitted_requests_total ",
    ):
        expected = _samples(reference_text, prefix)
        assert expected, prefix
        assert _samples(ours_text, prefix) == expected, prefix
    # Every tenant/lane pair has a _created sample, as prometheus_client's counters do.
    assert len(_samples(ours_text, "tokenfair_admitted_requests_created")) == 4


# -- request records: the direct encoder writes exactly what json writes ---------------------

_FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(10**6), 10**6).map(
    lambda ms: ms / 1000
)
_NAMES = st.text(min_size=1, max_size=12) | st.sampled_from(["bench", "tenant_info", "nancy"])


@settings(max_examples=300, deadline=None)
@given(
    request_id=_NAMES,
    tenant_id=_NAMES,
    priority=st.sampled_from(["interactive", "batch"]),
    status_code=st.sampled_from([200, 429, 499, 502, 503, 504]),
    reason=st.sampled_from([*Reason, *(member.value for member in Reason)]),  # member or str
    numbers=st.tuples(_FLOATS, _FLOATS, _FLOATS, _FLOATS),
    dispatch_ms=st.none() | _FLOATS,
    retry_after_ms=st.none() | _FLOATS,
    actual=st.none() | st.integers(0, 10**9),
    observed=st.dictionaries(st.sampled_from(["budget_wait_ms", "max_wait_ms"]), _FLOATS),
    usage=st.tuples(
        st.none() | st.integers(0, 10**6),
        st.none() | st.integers(0, 10**6),
        st.none() | _FLOATS,
        st.none() | _FLOATS,
    ),
)
def test_encode_record_is_json_byte_for_byte(
    request_id: str,
    tenant_id: str,
    priority: PriorityClass,
    status_code: int,
    reason: str,
    numbers: tuple[float, float, float, float],
    dispatch_ms: float | None,
    retry_after_ms: float | None,
    actual: int | None,
    observed: dict[str, float],
    usage: tuple[int | None, int | None, float | None, float | None],
) -> None:
    arrival_ms, occupancy, queue_wait_ms, decision_ttft_ms = numbers
    request = Request(request_id, tenant_id, arrival_ms, 14, 16, priority)
    decision = Decision(
        request_id, tenant_id, priority, status_code, reason, "dispatch", 78, arrival_ms,
        occupancy, queue_wait_ms, decision_ttft_ms, dispatch_ms, retry_after_ms, actual, observed,
    )  # fmt: skip
    outcome: dict[str, Any] = {
        "status_code": status_code,
        "reason": reason,
        "usage": Usage(*usage),
    }
    expected = json.JSONEncoder(separators=(",", ":")).encode(
        request_record(request, decision, "tokenfair", **outcome)
    )
    assert encode_record(request, decision, "tokenfair", **outcome) == expected
