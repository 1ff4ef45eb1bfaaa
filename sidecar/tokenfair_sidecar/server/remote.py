"""Long-poll the operator for this sidecar's config document: a change in about a second.

The kubelet refreshes a mounted ConfigMap or Secret on its own period (~60 s); the operator
serves the same bytes the moment it has stored them (``tokenfair_operator.serve``, and
``docs/architecture.md`` for why a long-poll and not a watch of the API). This module only
moves bytes; :mod:`.reload` decides what to do with them (the same loader, the same
refusals, the mounted file as the fallback).

Configured by the environment, which the injector sets:

* ``TOKENFAIR_CONFIG_URL`` — ``http://<operator>/v1/config/<namespace>/<policy>?source=...``;
  unset: no long-poll, the file alone (a standalone sidecar);
* ``TOKENFAIR_CONFIG_TOKEN_FILE`` — the ServiceAccount token sent as ``Bearer`` (default: the
  Pod's own, :data:`DEFAULT_TOKEN_FILE`), read again for each request (projected tokens rotate).

The loop: ``GET <url>&version=<the version we run>&waitSeconds=`` :data:`WAIT_S`. ``200``: a
new document, handed over with its version and its generation (header
:data:`GENERATION_HEADER`, a counter that only grows per policy; None from an operator that
sends none; :mod:`.reload` refuses to go back to a lower one); ``304``: nothing new, ask again
at once. Anything
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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp

from tokenfair_sidecar.config import MAX_DOCUMENT_BYTES

log = logging.getLogger("tokenfair.sidecar")

URL_ENV: Final = "TOKENFAIR_CONFIG_URL"
TOKEN_FILE_ENV: Final = "TOKENFAIR_CONFIG_TOKEN_FILE"
DEFAULT_TOKEN_FILE: Final = "/var/run/secrets/kubernetes.io/serviceaccount/token"
VERSION_HEADER: Final = "X-Tokenfair-Config-Version"
GENERATION_HEADER: Final = "X-Tokenfair-Config-Generation"
GENERATION_FILE: Final = "generation"
"""The generation's file beside the mounted ``config.yaml`` (a data key of the ConfigMap and
Secret the operator publishes; the kubelet swaps both files at once)."""
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
    """Where the document is served and the token to show."""

    url: str
    token_file: Path

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RemoteSource | None:
        url = env.get(URL_ENV, "").strip()
        if not url:
            return None
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"${URL_ENV}: must be an http:// or https:// URL (got {url[:80]!r})")
        return cls(url, Path(env.get(TOKEN_FILE_ENV) or DEFAULT_TOKEN_FILE))


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
        url = f"{self.source.url}{separator}waitSeconds={WAIT_S}"
        params = {"version": self.version}
        headers = {"Authorization": f"Bearer {self._token()}"}
        async with session.get(url, params=params, headers=headers) as response:
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
            return self.source.token_file.read_text().strip()
        except OSError as exc:
            raise RuntimeError(f"{self.source.token_file}: cannot read ({exc.strerror})") from None

    def _good(self) -> None:
        if self._failures:
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
    text = value.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise RuntimeError(f"generation must be a non-negative integer (got {text[:40]!r})")
    return int(text)


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
