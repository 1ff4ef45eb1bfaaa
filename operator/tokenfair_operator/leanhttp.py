"""GETs to the API server without the ``kubernetes`` client's machinery, for reads in bulk.

The first pass over 10,000 brand-new TenantQuotas reads 10,000 key Secrets by name. Through the
client each read cost ~0.5 ms of the operator's CPU (request serialisation, urllib3's pool and
response wrappers) — as much as the API server spent answering it, on the same two cores. A
plain ``http.client`` keep-alive connection per worker thread does the same GET for ~0.23 ms
(measured on the test control plane: 3,000 reads, 16 threads, 1.60 s → 0.84 s).

Only what the client's configuration says is honoured: the server URL, its CA bundle (or no
verification when the configuration turns it off), a client certificate, and the auth headers
the caller passes (the client's own, refreshed as the client refreshes them). A configuration
this does not cover (a proxy, a TLS server name or hostname override) gets no getter:
:meth:`LeanGetter.from_configuration` returns None and the caller keeps using the client.
"""

from __future__ import annotations

import http.client
import ssl
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit


@dataclass
class LeanGetter:
    """``GET`` over one keep-alive connection per thread (threads are the caller's pool)."""

    scheme: str
    host: str
    port: int
    context: ssl.SSLContext | None
    timeout_s: float
    _local: threading.local = field(default_factory=threading.local)
    _open: list[http.client.HTTPConnection] = field(default_factory=list)
    """Every connection open now, whatever thread made it: closed by :meth:`close`, or when the
    getter is collected (a thread's local slot dies with the thread; its socket must not be
    left to the garbage collector, which warns about an unclosed socket)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        weakref.finalize(self, _close_all, self._open, self._lock)

    @classmethod
    def from_configuration(cls, configuration: Any, timeout_s: float) -> LeanGetter | None:
        """A getter for a ``kubernetes.client.Configuration``; None when it asks for something
        this module does not do (see the module docstring)."""
        if configuration is None or getattr(configuration, "proxy", None):
            return None
        if getattr(configuration, "tls_server_name", None) or getattr(
            configuration, "assert_hostname", None
        ):
            return None
        parts = urlsplit(str(getattr(configuration, "host", "")))
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
            return None
        context = None
        if parts.scheme == "https":
            if getattr(configuration, "verify_ssl", True):
                context = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
            else:
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if getattr(configuration, "cert_file", None):
                context.load_cert_chain(configuration.cert_file, configuration.key_file or None)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, context, timeout_s)

    def get(
        self, path: str, query: list[tuple[str, str]], headers: Mapping[str, str]
    ) -> tuple[int, str, bytes]:
        """``(status, reason, body)`` of ``GET path?query``. A keep-alive connection the server
        closed meanwhile is replaced and the GET sent once more (a GET is safe to repeat);
        any other failure raises (``OSError``, ``http.client.HTTPException``)."""
        target = f"{path}?{urlencode(query)}" if query else path
        for attempt in (1, 2):
            connection = self._connection()
            try:
                connection.request("GET", target, headers=dict(headers))
                response = connection.getresponse()
                return response.status, response.reason, response.read()
            except (OSError, http.client.HTTPException):
                self._drop(connection)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close every connection (a later GET opens a new one)."""
        _close_all(self._open, self._lock)
        self._local = threading.local()

    def _drop(self, connection: http.client.HTTPConnection) -> None:
        connection.close()
        self._local.connection = None
        with self._lock:
            if connection in self._open:
                self._open.remove(connection)

    def _connection(self) -> http.client.HTTPConnection:
        connection: http.client.HTTPConnection | None = getattr(self._local, "connection", None)
        if connection is None:
            if self.scheme == "https":
                connection = http.client.HTTPSConnection(
                    self.host, self.port, timeout=self.timeout_s, context=self.context
                )
            else:
                connection = http.client.HTTPConnection(
                    self.host, self.port, timeout=self.timeout_s
                )
            self._local.connection = connection
            with self._lock:
                self._open.append(connection)
        return connection


def _close_all(connections: list[http.client.HTTPConnection], lock: threading.Lock) -> None:
    with lock:
        closing = list(connections)
        connections.clear()
    for connection in closing:
        connection.close()
