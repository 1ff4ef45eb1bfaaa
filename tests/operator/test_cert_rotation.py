"""The two-phase rotation of the operator's own certificate (``certs.advance``, ``CertKeeper``).

No wall clock: every time is given (the keeper's and the publisher's clocks are injected);
every certificate is checked by a real TLS handshake (OpenSSL's, over memory BIOs, its date
check off: the dates are the injected clock's), not by reading its fields back. The API is
in-memory fakes (the real-TLS end to end is in ``test_document_tls.py``).

Behaviours under test:

- the phases: nothing before renewal is due; then the next CA is published (the bundle holds
  both CAs, the current leaf is still served) and the leaf switches only once the next CA has
  been published for ``settle`` (not a second earlier); the previous CA stays in the bundle
  for another ``settle``, then is dropped. A client holding the bundle of the first phase
  verifies the server before, across and after the switch;
- the interval: ``trust_settle`` is twice the publishing round, the kubelet's sync period and
  its cache TTL (5 minutes by default);
- a current pair that cannot be served any more is replaced at once: by the pending next pair,
  else by a fresh one (the old CA kept in the bundle);
- bad input is reported and safe: a stored next pair that is unreadable, for other names,
  without or with a bad time, or published "in the future" is discarded and issued again; an
  unreadable previous CA is dropped; the bundle never holds an unreadable certificate;
- with the publisher asked (``reached``), the switch waits until every policy namespace's
  ConfigMap holds the next CA, ``settle`` counted from then (a week at most); the publisher
  says since when they all do: not while one write fails or before its first round or on a
  standby, from the first write or read that found it, again from a rewrite of its bundle
  (not from one of its owner references only: policy churn), and for a namespace added
  meanwhile;
- the Secret is the state: a rotation round-trips through its data at every phase, and a new
  keeper (a restarted operator, a new leader) goes on with the rotation another one began;
  the keeper writes the Secret only when something changed, repairs a Secret with corrupt
  parts, patches the webhooks' caBundle with the same bundle, and a standby (``follow``)
  writes the leader's leaf and bundle.
"""

from __future__ import annotations

import datetime
import logging
import ssl
from pathlib import Path
from typing import Any, cast

import pytest
from certs_support import NAMES, Clock, FakeCluster, server_context
from kubernetes.client import ApiException

from tokenfair_operator.certs import (
    NEXT_SINCE_KEY,
    PREVIOUS_CA_KEY,
    PREVIOUS_SINCE_KEY,
    RENEW_BEFORE,
    SWITCH_ANYWAY,
    TRUST_SETTLE,
    VALIDITY,
    Rotation,
    ServingCerts,
    Step,
    advance,
    issue,
    trust_settle,
)
from tokenfair_operator.serving_tls import NO_NAMESPACE_SINCE, TrustPublisher
from tokenfair_operator.views import PolicyView

T0 = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)
SETTLE = TRUST_SETTLE
SECOND = datetime.timedelta(seconds=1)
DUE = T0 + VALIDITY - RENEW_BEFORE + SECOND
"""The first second at which a pair issued at ``T0`` is due for renewal."""


NO_CHECK_TIME = 0x200000
"""OpenSSL's ``X509_V_FLAG_NO_CHECK_TIME``: the certificates here are issued at the injected
times, not the machine's, so a handshake checks the chain and the name, not the dates
(:func:`.certs.due` is what checks those)."""


def trusted(server: ServingCerts, bundle: bytes) -> bool:
    """A full TLS handshake (OpenSSL's, over memory BIOs) between a server presenting
    ``server``'s leaf and a client trusting only ``bundle``: whether the client accepts it."""
    client_ctx = ssl.create_default_context(cadata=bundle.decode())
    client_ctx.verify_flags |= NO_CHECK_TIME
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(to_client, to_server, server_hostname=NAMES[0])
    srv = server_context(server).wrap_bio(s_in, s_out, server_side=True)
    ends = [client, srv]
    try:
        for _ in range(20):
            for end in list(ends):
                try:
                    end.do_handshake()
                    ends.remove(end)
                except ssl.SSLWantReadError:
                    pass
            s_in.write(to_server.read())
            to_client.write(s_out.read())
            if not ends:
                return True
    except ssl.SSLCertVerificationError:
        return False
    raise AssertionError("handshake did not finish")


def test_the_settle_interval_is_derived_from_the_kubelet_and_the_publishing_round() -> None:
    assert datetime.timedelta(minutes=5) == TRUST_SETTLE  # 2 * (30 s + 60 s + 60 s)
    assert trust_settle(datetime.timedelta(seconds=5)) == datetime.timedelta(seconds=250)


def test_the_phases_publish_switch_and_drop() -> None:
    old = issue(NAMES, T0)
    state = Rotation(old)
    assert advance(state, NAMES, T0) == Step(state)
    assert advance(state, NAMES, DUE - SECOND) == Step(state)

    # Phase 1: renewal due. The next CA is published beside the current one; the old leaf
    # is still served.
    start = DUE
    published = advance(state, NAMES, start)
    state = published.rotation
    assert state.current == old
    assert state.next is not None
    assert state.next_since == start
    nxt = state.next
    assert len(published.events) == 1
    assert published.events[0].startswith("published the next CA (certificate expires in")
    bundle = state.bundle()
    assert trusted(old, bundle)
    assert trusted(nxt, bundle)
    assert not trusted(nxt, old.ca_pem)  # a client without the next CA would fail the switch

    # Not a second early: the leaf stays until the next CA has been out for `settle`.
    waiting = advance(state, NAMES, start + SETTLE - SECOND)
    assert waiting.rotation == state
    assert waiting.events == ()

    # Phase 2: the switch. The old CA stays trusted (a replica may still present the old leaf).
    switch_at = start + SETTLE
    switched = advance(state, NAMES, switch_at)
    state = switched.rotation
    assert switched.events[0].startswith("switched to the next certificate (its CA published")
    assert state.current == nxt
    assert state.next is None
    assert (state.previous_ca, state.previous_since) == (old.ca_pem, switch_at)
    assert trusted(nxt, state.bundle())
    assert trusted(old, state.bundle())
    assert trusted(nxt, bundle)  # the bundle of phase 1, never refreshed, verifies the new leaf

    # Phase 3: the old CA dropped, `settle` after the switch (not a second earlier).
    assert advance(state, NAMES, switch_at + SETTLE - SECOND).rotation == state
    dropped = advance(state, NAMES, switch_at + SETTLE)
    assert dropped.events == ("dropped the previous CA from the bundle",)
    assert dropped.rotation == Rotation(nxt)
    assert dropped.rotation.bundle() == nxt.ca_pem
    assert not trusted(old, dropped.rotation.bundle())


def test_every_phase_round_trips_through_the_secret() -> None:
    old = issue(NAMES, T0)
    start = DUE
    phase1 = advance(Rotation(old), NAMES, start).rotation
    phase2 = advance(phase1, NAMES, start + SETTLE).rotation
    for state in (Rotation(old), phase1, phase2):
        data = state.as_secret_data()
        assert Rotation.from_secret_data(data) == (state, [])
    assert sorted(phase1.as_secret_data()) == [
        "ca.crt",
        "next-ca.crt",
        "next-published-at",
        "next-tls.crt",
        "next-tls.key",
        "tls.crt",
        "tls.key",
    ]
    assert sorted(phase2.as_secret_data()) == [
        "ca.crt",
        "previous-ca.crt",
        "previous-retired-at",
        "tls.crt",
        "tls.key",
    ]
    assert Rotation.from_secret_data({}) == (None, [])


def test_a_current_pair_that_cannot_be_served_is_replaced_at_once() -> None:
    old = issue(NAMES, T0)
    start = DUE
    phase1 = advance(Rotation(old), NAMES, start).rotation
    assert phase1.next is not None
    # Less than `settle` left before it expires: the pending pair is served at once.
    late = T0 + VALIDITY - SETTLE + SECOND
    step = advance(phase1, NAMES, late)
    assert step.rotation.current == phase1.next
    assert step.events[0].startswith("switched to the next certificate (certificate expires in")
    # Nothing pending and other DNS names: a fresh pair at once, the old CA kept in the bundle.
    fresh = advance(Rotation(old), NAMES[:1], T0)
    assert fresh.events == (
        "issued a new certificate at once: stored certificate is for other DNS names",
    )
    assert fresh.rotation.current != old
    assert fresh.rotation.previous_ca == old.ca_pem
    assert trusted(old, fresh.rotation.bundle())
    # Nothing stored at all.
    first = advance(None, NAMES, T0)
    assert first.events == ("issued a new certificate: no certificate stored",)
    assert first.rotation.bundle() == first.rotation.current.ca_pem


@pytest.mark.parametrize(
    ("corrupt", "problem", "event"),
    [
        (
            {"next-tls.crt": b"junk"},
            None,
            "discarded the stored next certificate (certificate unreadable",
        ),
        ({"next-tls.key": b""}, "stored next certificate incomplete", None),
        ({NEXT_SINCE_KEY: b"yesterday"}, "without a valid next-published-at", None),
        ({NEXT_SINCE_KEY: b"2026-12-01T12:00:00"}, "without a valid next-published-at", None),
        ({NEXT_SINCE_KEY: b"\xff"}, "without a valid next-published-at", None),
        ({NEXT_SINCE_KEY: b"2027-12-01T12:00:00+00:00"}, None, "after now"),
    ],
)
def test_a_corrupt_pending_pair_is_reported_and_issued_again(
    corrupt: dict[str, bytes], problem: str | None, event: str | None
) -> None:
    old = issue(NAMES, T0)
    start = DUE
    phase1 = advance(Rotation(old), NAMES, start).rotation
    later = start + datetime.timedelta(minutes=1)
    stored, problems = Rotation.from_secret_data({**phase1.as_secret_data(), **corrupt})
    assert stored is not None
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1
        assert problem in problems[0]
    step = advance(stored, NAMES, later)
    if event is not None:
        assert event in step.events[0]
    # Issued again, its time now: the switch waits `settle` from now, the old leaf is served.
    assert step.rotation.current == old
    assert step.rotation.next is not None
    assert step.rotation.next != phase1.next
    assert step.rotation.next_since == later
    assert step.events[-1].startswith("published the next CA")
    assert trusted(old, step.rotation.bundle())
    assert trusted(step.rotation.next, step.rotation.bundle())


def test_a_pending_pair_for_other_names_is_discarded() -> None:
    old = issue(NAMES, T0)
    start = DUE
    stray = Rotation(old, issue(NAMES[:1], start), start)
    step = advance(stray, NAMES, start + SETTLE)
    assert step.rotation.current == old  # never switched to a leaf for other names
    assert (
        "discarded the stored next certificate (certificate is for other DNS names)"
        in (step.events[0])
    )
    assert step.rotation.next is not None
    assert step.rotation.next_since == start + SETTLE


def test_a_bad_previous_ca_is_dropped_and_never_bundled() -> None:
    current = issue(NAMES, T0)
    data = {**current.as_secret_data(), PREVIOUS_CA_KEY: b"junk"}
    data[PREVIOUS_SINCE_KEY] = T0.isoformat().encode()
    stored, problems = Rotation.from_secret_data(data)
    assert problems == ["stored previous CA unreadable or without a valid time"]
    assert stored == Rotation(current)
    # Built by hand (not from a Secret): the bundle still leaves what it cannot read out.
    odd = Rotation(current, previous_ca=b"junk", previous_since=T0)
    assert odd.bundle() == current.ca_pem
    # A retirement time in the future (another replica's clock) counts from now.
    other = issue(NAMES, T0)
    ahead = Rotation(current, previous_ca=other.ca_pem, previous_since=T0 + VALIDITY)
    kept = advance(ahead, NAMES, T0)
    assert kept.rotation.previous_since == T0
    assert trusted(other, kept.rotation.bundle())
    assert advance(kept.rotation, NAMES, T0 + SETTLE).rotation == Rotation(current)


def test_a_keeper_asks_whether_the_configmaps_hold_the_next_ca(tmp_path: Path) -> None:
    cluster = FakeCluster()
    old = issue(NAMES, T0)
    cluster.store(advance(Rotation(old), NAMES, DUE).rotation.as_secret_data())
    confirmed: list[datetime.datetime] = []
    clock = Clock(DUE + SETTLE)
    keeper = cluster.keeper(tmp_path, clock, reached=lambda _: confirmed[0] if confirmed else None)
    assert keeper.ensure() is None  # not confirmed yet: the old leaf stays
    assert keeper.files.cert.read_bytes() == old.key_pem + old.cert_pem
    confirmed.append(clock.now)
    assert keeper.ensure() is None  # confirmed just now: `settle` from now
    clock.now += SETTLE
    assert (keeper.ensure() or "").startswith("switched to the next certificate")


def test_a_new_keeper_goes_on_with_the_rotation_another_began(tmp_path: Path) -> None:
    cluster = FakeCluster()
    old = issue(NAMES, T0)
    cluster.store(old.as_secret_data())
    clock = Clock(DUE)
    first = cluster.keeper(tmp_path / "first", clock)
    reason = first.ensure()
    assert reason is not None
    assert reason.startswith("published the next CA")
    stored, _ = Rotation.from_secret_data(cluster.secret_data())
    assert stored is not None
    assert stored.current == old
    assert stored.next is not None
    nxt = stored.next
    # Files and caBundle: the old leaf, both CAs.
    assert first.files.cert.read_bytes() == old.key_pem + old.cert_pem
    assert first.files.ca.read_bytes() == stored.bundle() == cluster.ca_bundle()
    assert first.ensure() is None
    assert cluster.writes == 1  # nothing new: nothing written

    # The operator restarts (or another replica leads): a new keeper, only the Secret shared.
    clock.now += SETTLE - SECOND
    second = cluster.keeper(tmp_path / "second", clock)
    assert second.ensure() is None
    assert cluster.writes == 1
    assert second.files.cert.read_bytes() == old.key_pem + old.cert_pem  # still the old leaf
    clock.now += SECOND
    reason = second.ensure()
    assert reason is not None
    assert reason.startswith("switched to the next certificate")
    assert second.files.cert.read_bytes() == nxt.key_pem + nxt.cert_pem
    bundle = second.files.ca.read_bytes()
    assert bundle == cluster.ca_bundle()
    assert trusted(nxt, bundle)
    assert trusted(old, bundle)
    # A standby follows the Secret: the same leaf and bundle.
    standby = cluster.keeper(tmp_path / "standby", clock, leads=False)
    assert standby.follow() is True
    assert standby.files.cert.read_bytes() == second.files.cert.read_bytes()
    assert standby.files.ca.read_bytes() == bundle
    clock.now += SETTLE
    assert second.ensure() == "dropped the previous CA from the bundle"
    assert cluster.ca_bundle() == nxt.ca_pem == second.files.ca.read_bytes()
    assert cluster.writes == 3


def test_a_corrupt_secret_is_logged_and_repaired_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = FakeCluster()
    old = issue(NAMES, T0)
    phase1 = advance(Rotation(old), NAMES, DUE).rotation
    cluster.store(phase1.as_secret_data())
    assert cluster.data is not None
    cluster.data[NEXT_SINCE_KEY] = "!!not base64!!"
    clock = Clock(DUE + datetime.timedelta(hours=1))
    keeper = cluster.keeper(tmp_path, clock)
    with caplog.at_level(logging.WARNING, logger="tokenfair.operator"):
        reason = keeper.ensure()
    assert "next-published-at: not base64" in caplog.text
    assert "stored next certificate without a valid next-published-at" in caplog.text
    assert reason is not None
    assert reason.startswith("published the next CA")
    repaired, problems = Rotation.from_secret_data(cluster.secret_data())
    assert problems == []
    assert repaired is not None
    assert repaired.current == old
    assert repaired.next is not None
    assert repaired.next != phase1.next
    assert repaired.next_since == clock.now  # a new pair: `settle` counted from now


def test_the_switch_waits_until_every_configmap_holds_the_next_ca() -> None:
    old = issue(NAMES, T0)
    phase1 = advance(Rotation(old), NAMES, DUE).rotation
    assert phase1.next is not None
    nxt = phase1.next
    # The publisher has not confirmed: no switch after `settle`, nor days later...
    unconfirmed = advance(phase1, NAMES, DUE + datetime.timedelta(days=6), reached=lambda _: None)
    assert unconfirmed == Step(phase1)
    # ... but a week later: the current leaf must not run into its expiry.
    late = advance(phase1, NAMES, DUE + SWITCH_ANYWAY, reached=lambda _: None)
    assert late.rotation.current == nxt
    assert "not every ConfigMap confirmed to hold it" in late.events[0]
    # Confirmed after the Secret's time: `settle` counts from the confirmation.
    confirmed = DUE + datetime.timedelta(minutes=10)
    asked: list[bytes] = []

    def reached(ca_pem: bytes) -> datetime.datetime:
        asked.append(ca_pem)
        return confirmed

    assert advance(phase1, NAMES, confirmed + SETTLE - SECOND, reached=reached) == Step(phase1)
    assert asked == [nxt.ca_pem]
    assert advance(phase1, NAMES, confirmed + SETTLE, reached=reached).rotation.current == nxt
    # Confirmed before the Secret's time (found in line): the Secret's time counts.
    early = advance(phase1, NAMES, DUE + SETTLE, reached=lambda _: T0)
    assert early.rotation.current == nxt


class FakeConfigMaps:
    """The publisher's API: ConfigMaps by namespace; ``failing`` namespaces refuse writes."""

    def __init__(self) -> None:
        self.maps: dict[str, Any] = {}
        self.failing: set[str] = set()

    def read_namespaced_config_map(self, name: str, namespace: str, **_: Any) -> Any:
        if namespace not in self.maps:
            raise ApiException(status=404, reason="Not Found")
        return self.maps[namespace]

    def create_namespaced_config_map(self, namespace: str, body: Any, **_: Any) -> None:
        self._write(namespace, body)

    def replace_namespaced_config_map(self, name: str, namespace: str, body: Any, **_: Any) -> None:
        self._write(namespace, body)

    def _write(self, namespace: str, body: Any) -> None:
        if namespace in self.failing:
            raise ApiException(status=500, reason="Internal Server Error")
        self.maps[namespace] = body


def views(*namespaces: str) -> dict[str, list[PolicyView]]:
    return {ns: [PolicyView("pool", ns, f"uid-{ns}", 1, "")] for ns in namespaces}


def test_the_publisher_says_since_when_every_namespace_holds_a_ca() -> None:
    api = FakeConfigMaps()
    clock = Clock(T0)
    publisher = TrustPublisher(None, recheck_rounds=3, clock=clock)
    publisher._core = cast(Any, api)
    old, nxt = issue(NAMES, T0), issue(NAMES, T0)
    bundle = Rotation(old, nxt, T0).bundle()
    leads = True
    assert publisher.holding_since(nxt.ca_pem) is None  # no round yet

    # One namespace's write fails: not every one holds it.
    api.failing.add("b")
    with pytest.raises(ApiException):
        publisher.publish(bundle, views("a", "b"), lambda: leads)
    assert publisher.holding_since(nxt.ca_pem) is None
    clock.now += datetime.timedelta(minutes=1)
    api.failing.clear()
    assert publisher.publish(bundle, views("a", "b"), lambda: leads) == ["b"]
    assert publisher.holding_since(nxt.ca_pem) == T0 + datetime.timedelta(minutes=1)  # b's time
    assert publisher.holding_since(old.ca_pem) == T0 + datetime.timedelta(minutes=1)
    assert publisher.holding_since(issue(NAMES, T0).ca_pem) is None  # a CA nobody holds

    # Read again and found in line (the periodic re-read, every 3rd round here): the earlier
    # time stays. Replaced by someone and written again: counted from the new write.
    clock.now += datetime.timedelta(minutes=1)
    assert publisher.publish(bundle, views("a", "b"), lambda: leads) == []  # the 3rd: re-read
    assert publisher.holding_since(nxt.ca_pem) == T0 + datetime.timedelta(minutes=1)
    api.maps["a"].data = {"ca.crt": old.ca_pem.decode()}
    assert publisher.publish(bundle, views("a", "b"), lambda: leads) == []  # remembered
    assert publisher.publish(bundle, views("a", "b"), lambda: leads) == []
    assert publisher.publish(bundle, views("a", "b"), lambda: leads) == ["a"]  # 6th: re-read
    assert publisher.holding_since(nxt.ca_pem) == T0 + datetime.timedelta(minutes=2)
    # Leading anew (`forget`): nothing confirmed until read again, then from that read.
    publisher.forget()
    assert publisher.holding_since(nxt.ca_pem) is None
    clock.now += datetime.timedelta(minutes=1)
    assert publisher.publish(bundle, views("a", "b"), lambda: leads) == []
    assert publisher.holding_since(nxt.ca_pem) == T0 + datetime.timedelta(minutes=3)

    # A namespace with a new policy and no ConfigMap yet is waited for too.
    clock.now += datetime.timedelta(minutes=1)
    assert publisher.publish(bundle, views("a", "b", "c"), lambda: leads) == ["c"]
    assert publisher.holding_since(nxt.ca_pem) == T0 + datetime.timedelta(minutes=4)
    # Not the leader: nothing confirmed. No policy anywhere: nothing to wait for.
    leads = False
    assert publisher.publish(bundle, views("a"), lambda: leads) == []
    assert publisher.holding_since(nxt.ca_pem) is None
    leads = True
    assert publisher.publish(bundle, {}, lambda: leads) == []
    assert publisher.holding_since(nxt.ca_pem) == NO_NAMESPACE_SINCE


def test_a_rewrite_of_the_owners_only_keeps_the_time_a_bundle_is_held() -> None:
    """Policy churn rewrites a ConfigMap's owner references, not its bundle: the time it holds
    the bundle since stays (else every change of policies would put off the switch)."""
    api = FakeConfigMaps()
    clock = Clock(T0)
    publisher = TrustPublisher(None, clock=clock)
    publisher._core = cast(Any, api)
    old, nxt = issue(NAMES, T0), issue(NAMES, T0)
    bundle = Rotation(old, nxt, T0).bundle()
    assert publisher.publish(bundle, views("a"), lambda: True) == ["a"]
    for n in range(1, 4):  # a policy added, another, then one deleted: owners rewritten
        clock.now += datetime.timedelta(minutes=10)
        policies = [PolicyView(f"pool{i}", "a", f"uid-{i}", 1, "") for i in range(n % 3 + 1)]
        assert publisher.publish(bundle, {"a": policies}, lambda: True) == ["a"]
        assert [ref.uid for ref in api.maps["a"].metadata.owner_references] == [
            p.uid for p in policies
        ]
        assert publisher.holding_since(nxt.ca_pem) == T0
    # A new bundle: counted from its write.
    clock.now += datetime.timedelta(minutes=10)
    later = issue(NAMES, T0)
    assert publisher.publish(Rotation(nxt, later, T0).bundle(), views("a"), lambda: True) == ["a"]
    assert publisher.holding_since(later.ca_pem) == T0 + datetime.timedelta(minutes=40)
