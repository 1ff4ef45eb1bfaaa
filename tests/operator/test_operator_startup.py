"""The startup hook: its settings, its retries, what it registers and what it shares.

Behaviours under test, without a cluster (an in-memory Lease stands in for the API server's,
the electors' clocks are frozen: nothing waits on wall time):

- every environment setting that does not parse is refused naming its variable, and the
  startup hook turns that into a ``kopf.PermanentError`` (the operator stops, no retry) before
  anything starts;
- a startup that fails after the leader elector started (here: the HTTP port cannot be bound)
  stops what it started, releasing the Lease, before Kopf retries it; the retry runs one elector,
  under the same identity (the settings are read once per process), which leads;
- a port of the HTTP server that cannot be bound leaves the other one unbound too;
- the admission handlers are registered once in a registry, however often asked;
- Kopf's index handlers carry the names :class:`.indexes.Indexes` reads them by;
- the generations each object's handlers record through their own copy of the memo (Kopf's
  ``copy.copy`` per object) are the ones the resync round prunes on the operator's memo.
"""

from __future__ import annotations

import asyncio
import copy
import errno
import inspect
import logging
import os
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable
from typing import Any, cast

import kopf
import pytest
from aiohttp import web
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from loopback_support import free_ports

from tokenfair_operator import handlers, runtime, startup
from tokenfair_operator.indexes import POLICIES, QUOTAS, SIDECARS
from tokenfair_operator.leader import LeaderElector
from tokenfair_operator.passes import news
from tokenfair_operator.resync import prune_generations
from tokenfair_operator.serve import start_server
from tokenfair_operator.settings import (
    KOPF_OBJECTS_LOGGER,
    OperatorConfig,
    QuietSuccesses,
    configure_kopf,
)

ELECTION_TASK = "tokenfair-leader-election"
CONFIGURE = cast(Callable[..., Awaitable[None]], handlers.configure)
"""The startup hook, called as Kopf calls it (Kopf's decorator retypes it)."""


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ``TOKENFAIR_*`` variable of the test run's own environment reaches the settings."""
    for name in [name for name in os.environ if name.startswith("TOKENFAIR_")]:
        monkeypatch.delenv(name)
    return monkeypatch


# --- settings: a bad value names its variable -----------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "rule"),
    [
        ("TOKENFAIR_RESYNC_SECONDS", "abc", "must be a number"),
        ("TOKENFAIR_RESYNC_SECONDS", "0", "must be > 0"),
        ("TOKENFAIR_USAGE_SECONDS", "nan", "must be finite"),
        ("TOKENFAIR_USAGE_SECONDS", "-5", "must be > 0"),
        ("TOKENFAIR_HTTP_PORT", "x", "TCP port"),
        ("TOKENFAIR_HTTPS_PORT", "70000", "TCP port"),
        ("TOKENFAIR_WEBHOOK_PORT", "eight", "TCP port"),
        ("TOKENFAIR_RELAY_CONNECTIONS", "lots", "must be an integer"),
        ("TOKENFAIR_RELAY_CONNECTIONS", "0", "must be > 0"),
        ("TOKENFAIR_WEBHOOK_CERT_SECRET", "bad", "namespace/name"),
        ("TOKENFAIR_WEBHOOK_CERT_SECRET", "ns/a/b", "namespace/name"),
        ("TOKENFAIR_LEADER_ELECTION", "yes", "true or false"),
        ("TOKENFAIR_CONFIG_INSECURE_HTTP", "maybe", "true or false"),
        ("TOKENFAIR_INJECTION_FAILURE_POLICY", "Sometimes", "one of Fail, Ignore"),
        ("TOKENFAIR_SIDECAR_MAX_IN_FLIGHT", "-3", r"must be in \[1, 100000\]"),
    ],
)
def test_a_bad_setting_names_its_variable(variable: str, value: str, rule: str) -> None:
    with pytest.raises(ValueError, match=rule) as caught:
        OperatorConfig.from_env({variable: value})
    assert f"${variable}:" in str(caught.value)
    assert f"(got {value}" in str(caught.value).replace("'", "")


def test_good_settings_parse_and_other_variables_stay_out() -> None:
    env = {
        "TOKENFAIR_RESYNC_SECONDS": "2.5",
        "TOKENFAIR_HTTP_PORT": " 8081 ",
        "TOKENFAIR_WEBHOOK_PORT": "9443",
        "TOKENFAIR_RELAY_CONNECTIONS": "50",
        "TOKENFAIR_WEBHOOK_CERT_SECRET": "tf/operator-cert",
        "TOKENFAIR_WEBHOOK_DNS_NAMES": "a.tf.svc, ,b.tf.svc",
        "TOKENFAIR_POD_NAME": "op-0",
        # Not ours: once read as the webhook's host and address (a prefix removed from all).
        "HOST": "elsewhere",
        "ADDR": "10.0.0.1",
    }
    config = OperatorConfig.from_env(env)
    assert config.resync_interval_s == 2.5
    assert (config.http_port, config.webhook_port, config.https_port) == (8081, 9443, None)
    assert config.relay_connections == 50
    assert config.webhook_cert_secret == ("tf", "operator-cert")
    assert config.webhook_dns_names == ("a.tf.svc", "b.tf.svc")
    assert (config.webhook_host, config.webhook_addr) == (None, "0.0.0.0")
    assert config.identity.startswith("op-0_")
    assert OperatorConfig.from_env(env).identity == config.identity  # drawn once per process


async def test_the_startup_hook_stops_the_operator_on_a_bad_setting(
    clean_env: pytest.MonkeyPatch,
) -> None:
    def no_api() -> Any:
        raise AssertionError("nothing starts with a bad setting")

    clean_env.setattr(startup, "api_client", no_api)
    clean_env.setenv("TOKENFAIR_RESYNC_SECONDS", "abc")
    memo = kopf.Memo()
    with pytest.raises(kopf.PermanentError, match=r"\$TOKENFAIR_RESYNC_SECONDS: ") as caught:
        await CONFIGURE(
            settings=kopf.OperatorSettings(), memo=memo, logger=logging.getLogger("test")
        )
    assert "'abc'" in str(caught.value)
    assert runtime.CONFIG not in memo


# --- a retried startup: one elector, the same identity ---------------------------------------


class FakeLeases:
    """``CoordinationV1Api``'s Lease calls over one in-memory Lease (no resourceVersion: the
    test has one writer at a time)."""

    def __init__(self) -> None:
        self.lease: client.V1Lease | None = None
        self.lock = threading.Lock()

    @property
    def holder(self) -> str | None:
        with self.lock:
            if self.lease is None or self.lease.spec is None:
                return None
            return str(self.lease.spec.holder_identity or "")

    def read_namespaced_lease(self, name: str, namespace: str, **_: Any) -> client.V1Lease:
        with self.lock:
            if self.lease is None:
                raise ApiException(status=404)
            return copy.deepcopy(self.lease)

    def create_namespaced_lease(self, namespace: str, body: client.V1Lease, **_: Any) -> None:
        with self.lock:
            if self.lease is not None:
                raise ApiException(status=409)
            self.lease = copy.deepcopy(body)

    def replace_namespaced_lease(
        self, name: str, namespace: str, body: client.V1Lease, **_: Any
    ) -> None:
        with self.lock:
            self.lease = copy.deepcopy(body)


def election_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == ELECTION_TASK and not t.done()]


async def test_a_failed_start_stops_its_elector_and_the_retry_keeps_the_identity(
    clean_env: pytest.MonkeyPatch,
) -> None:
    leases = FakeLeases()
    electors: list[LeaderElector] = []

    class RecordedElector(LeaderElector):
        """The real elector over the in-memory Lease, on a frozen clock."""

        def __post_init__(self) -> None:
            self.coordination = leases
            self.clock = lambda: 0.0
            electors.append(self)

    apis: list[client.ApiClient] = []

    def api_client() -> client.ApiClient:
        apis.append(client.ApiClient(client.Configuration()))
        return apis[-1]

    binds: list[int | None] = []

    async def port_taken_once(app: web.Application, addr: str, port: int | None, *_: Any) -> Any:
        """The first attempt's port is still held (a bind failure); the retry's is free."""
        binds.append(port)
        if len(binds) == 1:
            raise OSError(errno.EADDRINUSE, "address already in use")
        runner = web.AppRunner(app)
        await runner.setup()  # no site: nothing listens
        return runner

    clean_env.setattr(startup, "LeaderElector", RecordedElector)
    clean_env.setattr(startup, "api_client", api_client)
    clean_env.setattr(startup, "start_server", port_taken_once)
    for name, value in {
        "TOKENFAIR_LEADER_ELECTION": "true",
        "TOKENFAIR_POD_NAME": "op-0",
        "TOKENFAIR_HTTP_PORT": "18081",
        "TOKENFAIR_HTTP_ADDR": "127.0.0.1",
        "TOKENFAIR_HTTP_ADVERTISE": "op-0:18081",
    }.items():
        clean_env.setenv(name, value)
    memo = kopf.Memo()
    indexes: dict[str, Any] = {POLICIES: {}, QUOTAS: {}, SIDECARS: {}}

    async def startup_hook() -> None:
        await CONFIGURE(
            settings=kopf.OperatorSettings(),
            memo=memo,
            logger=logging.getLogger("test"),
            **indexes,
        )

    with pytest.raises(OSError, match="address already in use"):
        await startup_hook()  # Kopf logs it and runs the hook again a minute later
    first = electors[0]
    assert first.identity.startswith("op-0_")
    assert election_tasks() == []  # the elector stopped with the attempt
    assert leases.holder == ""  # and released the Lease it had taken
    assert not runtime.leads(memo)  # the stopped elector tells writers so
    assert runtime.PERIODIC not in memo
    assert runtime.SERVER not in memo
    config = memo[runtime.CONFIG]

    await startup_hook()  # the retry
    try:
        assert len(electors) == 2
        second = electors[1]
        assert second.identity == first.identity
        assert memo[runtime.CONFIG] is config  # read once per process
        assert memo[runtime.ELECTOR] is second
        assert len(election_tasks()) == 1  # the retry's, not the failed attempt's
        assert second.is_leader
        assert runtime.leads(memo)
        assert leases.holder == second.identity
        assert binds == [18081, 18081]

        # The generations record is the operator memo's, shared by each object's copy.
        body = kopf.Body(cast(Any, {"metadata": {"uid": "gone", "generation": 1}}))
        assert news(copy.copy(memo), "ADDED", body)
        assert runtime.generations(memo) == {"gone": (1, False)}
        prune_generations(memo, {}, {})  # type: ignore[arg-type]
        assert runtime.generations(memo) == {}
    finally:
        await startup.stop(memo)  # the cleanup hook
    assert election_tasks() == []
    assert leases.holder == ""
    await startup.stop(memo)  # idempotent
    for api in apis:
        api.close()  # type: ignore[no-untyped-call]


async def test_a_port_that_cannot_be_bound_leaves_neither_bound() -> None:
    plain, tls = free_ports(2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", tls))
        held.listen()
        with pytest.raises(OSError, match=r"(?i)address already in use") as caught:
            await start_server(
                web.Application(),
                "127.0.0.1",
                plain,
                tls,
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH),
            )
        assert caught.value.errno == errno.EADDRINUSE
    with socket.socket() as again:
        again.bind(("127.0.0.1", plain))  # the plain port was let go with the failure


# --- registrations -------------------------------------------------------------------------


def test_webhooks_are_registered_once_however_often_asked() -> None:
    registry = kopf.OperatorRegistry()
    config = OperatorConfig(webhook_port=9443)
    handlers.register_webhooks(registry, config)
    handlers.register_webhooks(registry, config)  # e.g. a retried startup hook, a fresh memo
    ids = sorted(h.id for h in registry._webhooks.get_all_handlers())
    assert ids == sorted([handlers.ADMIT_POLICY_ID, handlers.ADMIT_QUOTA_ID, handlers.INJECT_ID])


def test_the_index_handlers_carry_the_names_the_indexes_are_read_by() -> None:
    registry = kopf.get_default_registry()
    ours = {
        h.id for h in registry._indexing.get_all_handlers() if h.fn.__module__ == handlers.__name__
    }
    assert ours == {POLICIES, QUOTAS, SIDECARS}


def test_kopf_runs_every_handler_of_ours_on_the_loop_and_keeps_no_diff() -> None:
    """Kopf runs a plain function in its thread pool (a hop per event: 10,000 per 10,000
    listed quotas), so the index and event handlers are coroutines; and with event handlers
    only, the diff-base is never used, so it builds nothing (:class:`.settings.NoDiffBase`): a
    change handler (``on.create``/``update``/``field``...) would see no diff, so none may be
    registered."""
    registry = kopf.get_default_registry()
    ours = [
        h
        for h in [*registry._indexing.get_all_handlers(), *registry._watching.get_all_handlers()]
        if h.fn.__module__ == handlers.__name__
    ]
    assert len(ours) == 6
    assert all(inspect.iscoroutinefunction(h.fn) for h in ours), [h.id for h in ours]
    assert registry._changing.get_all_handlers() == []
    settings = kopf.OperatorSettings()
    configure_kopf(settings, OperatorConfig())
    body = kopf.Body(cast(Any, {"metadata": {"uid": "u"}, "spec": {"weight": 1}}))
    assert settings.persistence.diffbase_storage.build(body=body) == {}


def test_kopf_logs_no_line_per_event_for_handlers_that_succeeded() -> None:
    """Kopf logs "Handler '<id>' succeeded." at every watch event (20,000 lines for 10,000
    quotas and their status writes): dropped for our event handlers, nothing else."""
    registry = kopf.get_default_registry()
    ours = {
        h.id for h in registry._watching.get_all_handlers() if h.fn.__module__ == handlers.__name__
    }
    assert ours == set(handlers.EVENT_HANDLERS)
    objects = logging.getLogger(KOPF_OBJECTS_LOGGER)
    quiet = [f for f in objects.filters if isinstance(f, QuietSuccesses)]
    assert len(quiet) == 1  # installed once, by importing the handlers

    def shown(message: str) -> bool:
        record = objects.makeRecord(objects.name, logging.INFO, "", 0, message, (), None)
        return objects.filter(record)

    assert not shown("Handler 'quota_event' succeeded.")
    assert shown("Handler 'quota_event' failed with an exception and will ignore it: boom")
    assert shown("Handler 'some_other' succeeded.")
    assert shown("published config version 0123456789abcdef (generation 1) to ConfigMap x")


# --- the generations record ----------------------------------------------------------------


def test_generations_need_the_record_the_startup_hook_shares() -> None:
    """A record made in one object's copy of the memo would be seen by no one: refused."""
    body = kopf.Body(cast(Any, {"metadata": {"uid": "u", "generation": 1}}))
    with pytest.raises(RuntimeError, match="startup hook"):
        news(copy.copy(kopf.Memo()), "ADDED", body)
