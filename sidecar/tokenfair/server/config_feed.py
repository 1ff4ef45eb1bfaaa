"""Long-poll the operator for this sidecar's config document: a change in about a second.

The kubelet refreshes a mounted ConfigMap or Secret on its own period (~60 s); the operator
serves the same bytes the moment it has stored them (``tokenfair_operator.serve``, and
``docs/architecture.md`` for why a long-poll and not a watch of the API). This module only
moves bytes; :mod:`.reload` decides what to do with them (the same loader, the same
refusals, the mounted file as the fallback).

Configured by the environment, which the injector sets (the names, headers and files both sides
use live in :mod:`tokenfair.config.wire`):

* ``TOKENFAIR_CONFIG_URL`` — ``https://<operator>/v1/config/<namespace>/<policy>?source=...``;
  unset: no long-poll, the file alone (a standalone sidecar);
* ``TOKENFAIR_CONFIG_CA_FILE`` — the PEM CA bundle the server's certificate must chain to (the
  operator's own CA, projected from a ConfigMap; the server's name is the URL's host); read
  again for each request (the kubelet refreshes it after a rotation); unset: the system's
  trust store;
* ``TOKENFAIR_CONFIG_TOKEN_FILE`` — the ServiceAccount token sent as ``Bearer`` (default: the
  Pod's own, :data:`DEFAULT_TOKEN_FILE`; the injector projects one for the document server's
  audience only, valid 10 minutes), read again for each request (the kubelet rotates it);
* ``TOKENFAIR_CONFIG_INSECURE_HTTP`` — ``true`` allows an ``http://`` URL: unsafe (the token
  and the document travel in clear, anyone on the path can change the document), for a local
  operator in tests only; otherwise an ``http://`` URL is refused (logged; no long-poll, the
  file alone).

A server whose certificate does not verify is a failed poll like any other: the last good
config stays and the mounted file is the fallback.

The loop: ``GET <url>&version=<the version we run>&waitSeconds=`` :data:`WAIT_S`. ``200``: a
new document, handed over with its version and its generation (header
:data:`~tokenfair.config.wire.GENERATION_HEADER`, a counter that only grows per policy; None
from an operator that sends none; :mod:`.reload` refuses to go back to a lower one); ``304``:
nothing new, ask again at once. Anything
else (a ``200`` without the version header, a refusal, a 404 from an operator that has not
rendered the policy yet, a connection error, a timeout) waits ``min(`` :data:`MAX_BACKOFF_S`
``, 2^failures)`` seconds and asks again, and marks the feed unhealthy at once. The feed is
healthy while its last answer was good and is at most ``WAIT_S +`` :data:`HEALTH_GRACE_S`
seconds old (a request that hangs without an answer); only then is the mounted file a mere
fallback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp

from tokenfair.config import MAX_DOCUMENT_BYTES
from tokenfair.config.files import InputFileError, read_regular
from tokenfair.config.wire import (
    CA_FILE_ENV,
    GENERATION_HEADER,
    INSECURE_HTTP_ENV,
    MAX_GENERATION_DIGITS,
    TOKEN_FILE_ENV,
    URL_ENV,
    VERSION_HEADER,
    VERSION_PARAM,
    WAIT_PARAM,
    read_generation,
)

log = logging.getLogger("tokenfair.sidecar")

DEFAULT_TOKEN_FILE: Final = "/var/run/secrets/kubernetes.io/serviceaccount/token"
MAX_TOKEN_BYTES: Final = 64 * 1024
"""Largest ServiceAccount token read (a projected token is ~1 KB)."""
MAX_CA_BUNDLE_BYTES: Final = 1024 * 1024
"""Largest CA bundle read (a few certificates: a few KB)."""
WAIT_S: Final = 30
"""Seconds the operator may hold one request (its default; under common idle timeouts)."""
CONNECT_TIMEOUT_S: Final = 5.0
HEALTH_GRACE_S: Final = 15.0
"""Beyond a long-poll's wait, how long without a good answer before the file takes over."""
MAX_BACKOFF_S: Final = 10.0
"""Longest pause between failed requests: an operator back from a restart is heard within it."""

Deliver = Callable[[bytes, str, int | None], None]
"""Called with a document's bytes, its version and its generation (None: not sent); never
raises (:mod:`.reload` reports)."""


@dataclass(frozen=True, slots=True)
class RemoteSource:
    """Where the document is served, the token to show and the CA bundle that verifies the
    server (None: the system's trust store)."""

    url: str
    token_file: Path
    ca_file: Path | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RemoteSource | None:
        url = env.get(URL_ENV, "").strip()
        if not url:
            return None
        insecure = env.get(INSECURE_HTTP_ENV, "").strip().lower() == "true"
        if not url.startswith("https://") and not (url.startswith("http://") and insecure):
            raise ValueError(
                f"${URL_ENV}: must be an https:// URL (got {url[:80]!r}); http:// only with "
                f"${INSECURE_HTTP_ENV}=true (unsafe: the token and the document in clear)"
            )
        ca_file = env.get(CA_FILE_ENV, "").strip()
        token_file = Path(env.get(TOKEN_FILE_ENV) or DEFAULT_TOKEN_FILE)
        return cls(url, token_file, Path(ca_file) if ca_file else None)


class RemoteFeed:
    """The long-poll loop and its health; :meth:`run` never raises (but for cancellation)."""

    def __init__(
        self, source: RemoteSource, deliver: Deliver, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.source = source
        self.deliver = deliver
        self.clock = clock
        self.version = ""
        """The version last delivered ("" before the first: the operator answers at once)."""
        self._good_at: float | None = None
        self._failures = 0
        self._answered = False
        self._trust: tuple[bytes, ssl.SSLContext] | None = None
        """The CA bundle last read and its context (one per bundle: connections are reused)."""

    def healthy(self) -> bool:
        """A good answer (200 or 304) came within ``WAIT_S + HEALTH_GRACE_S`` seconds."""
        good = self._good_at
        return good is not None and self.clock() - good <= WAIT_S + HEALTH_GRACE_S

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=WAIT_S + HEALTH_GRACE_S, connect=CONNECT_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
            while True:
                try:
                    await self._poll(session)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the feed must outlive any failure
                    self._failed(f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(min(MAX_BACKOFF_S, 2.0 ** min(self._failures, 8)))

    async def _poll(self, session: aiohttp.ClientSession) -> None:
        separator = "&" if "?" in self.source.url else "?"
        url = f"{self.source.url}{separator}{WAIT_PARAM}={WAIT_S}"
        params = {VERSION_PARAM: self.version}
        headers = {"Authorization": f"Bearer {self._token()}"}
        context = self._ssl()
        async with session.get(url, params=params, headers=headers, ssl=context) as response:
            if response.status == 304:
                self._good()
                return
            if response.status != 200:
                reason = (await response.content.read(500)).decode(errors="replace").strip()
                raise RuntimeError(f"HTTP {response.status}: {reason}")
            version = response.headers.get(VERSION_HEADER)
            if version is None:
                # Not a document we can track: delivering it as version "" would be answered
                # at once again, and again (a hot loop); a failed poll, with the backoff.
                raise RuntimeError(f"HTTP 200 without a {VERSION_HEADER} header")
            generation = parse_generation(response.headers.get(GENERATION_HEADER))
            body = await _bounded_body(response)
        self._good()
        self.version = version  # also when refused: asked again only for another version
        self.deliver(body, version, generation)

    def _token(self) -> str:
        try:
            token = read_regular(self.source.token_file, MAX_TOKEN_BYTES)
        except InputFileError as exc:
            raise RuntimeError(str(exc)) from None
        except OSError as exc:
            raise RuntimeError(f"{self.source.token_file}: cannot read ({exc.strerror})") from None
        return token.decode(errors="replace").strip()

    def _ssl(self) -> ssl.SSLContext | bool:
        """The context verifying the server: from the CA file as it is now (re-read each poll,
        rebuilt only when it changed), else the system's (``True``)."""
        path = self.source.ca_file
        if path is None:
            return True
        try:
            bundle = read_regular(path, MAX_CA_BUNDLE_BYTES)
        except InputFileError as exc:
            raise RuntimeError(f"the CA bundle {exc}") from None
        except OSError as exc:
            raise RuntimeError(f"{path}: cannot read the CA bundle ({exc.strerror})") from None
        if self._trust is None or self._trust[0] != bundle:
            try:
                context = ssl.create_default_context(cadata=bundle.decode(errors="replace"))
            except (ssl.SSLError, ValueError) as exc:
                raise RuntimeError(f"{path}: not a PEM CA bundle ({exc})") from None
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            self._trust = (bundle, context)
        return self._trust[1]

    def _good(self) -> None:
        if not self._answered:  # once: says which transport the sidecar runs on
            self._answered = True
            ca = self.source.ca_file
            how = f"server verified with {ca}" if ca is not None else "system trust store"
            if self.source.url.startswith("http://"):
                how = "plain HTTP: unsafe"
            log.info("config long-poll of %s answers (%s)", self.source.url, how)
        elif self._failures:
            log.info("config long-poll of %s answers again", self.source.url)
        self._good_at = self.clock()
        self._failures = 0

    def _failed(self, why: str) -> None:
        self._good_at = None  # an answer that is not good hands over to the file at once
        if self._failures == 0:  # once per outage: a down operator costs one log line
            log.warning(
                "config long-poll of %s failed (%s); the last good config stays, the mounted "
                "file is the fallback",
                self.source.url,
                why,
            )
        self._failures += 1


def parse_generation(value: str | None) -> int | None:
    """A generation header or file: None when absent; a non-negative integer, else refused."""
    if value is None:
        return None
    parsed = read_generation(value)
    if parsed is None:
        raise RuntimeError(
            f"generation must be a non-negative integer of 1 to {MAX_GENERATION_DIGITS} digits "
            f"(got {value.strip()[:40]!r})"
        )
    return parsed


async def _bounded_body(response: aiohttp.ClientResponse) -> bytes:
    """The body, refused beyond :data:`MAX_DOCUMENT_BYTES` (a document, compressed or not)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > MAX_DOCUMENT_BYTES:
            raise RuntimeError(f"document over {MAX_DOCUMENT_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
