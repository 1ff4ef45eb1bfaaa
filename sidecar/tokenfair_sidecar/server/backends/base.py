"""The backend contract: run one dispatched request and answer the client.

``respond(call)`` must either raise :class:`UpstreamError` before anything was sent to the client
(the proxy then answers with its status: 502 refused/reset, 504 timeout), or answer the client
itself (a ``web.Response``, or a prepared ``web.StreamResponse`` for SSE). While it runs it fills
in ``call.prompt_tokens`` / ``call.completion_tokens`` (the usage to settle) and calls
``call.first_byte()`` when the first body bytes go out (TTFT). It may be cancelled at any await
(the client went away); it must then free what it holds (an upstream connection) and re-raise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from aiohttp import web

from tokenfair_sidecar.core import Decision
from tokenfair_sidecar.server.estimate import Estimate

ROUTES = ("/v1/completions", "/v1/chat/completions")


class UpstreamError(Exception):
    """The backend failed before the response started; ``status`` is 502 or 504."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(slots=True, eq=False)
class BackendCall:
    """One dispatched request as a backend sees it, plus what the backend reports back."""

    request: web.Request
    path: str
    body: dict[str, Any]
    raw_body: bytes
    stream: bool
    estimate: Estimate
    decision: Decision
    response_headers: Mapping[str, str]
    """Headers the proxy adds to the response (rate-limit headers, request id)."""
    on_first_byte: Callable[[], None]
    dispatched_at_s: float
    """Event-loop time when the scheduler dispatched the request."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_byte_sent: bool = field(default=False)

    def first_byte(self) -> None:
        if not self.first_byte_sent:
            self.first_byte_sent = True
            self.on_first_byte()


class Backend(ABC):
    """One model server behind the sidecar."""

    name: ClassVar[str]
    default_max_in_flight: ClassVar[int]

    async def open(self) -> None:
        """Acquire long-lived resources (called from the app's cleanup context)."""

    async def close(self) -> None:
        """Release them."""

    @abstractmethod
    async def respond(self, call: BackendCall) -> web.StreamResponse:
        """Run ``call`` and answer the client (see the module docstring)."""

    def kv_hold_ms(self, call: BackendCall) -> float:
        """Model ms after dispatch until the request's KV blocks are free (0: at completion)."""
        return 0.0
