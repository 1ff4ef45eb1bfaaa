"""Fetch the sidecars' ``/metrics`` over HTTP (their admin port), concurrently and bounded.

A sidecar that does not answer within ``timeout_s`` is skipped for this round (it shows in
``status.usage.sidecars``); usage is best effort and never blocks reconciling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp

from tokenfair.config.wire import METRICS_PATH


async def scrape_metrics(addresses: Sequence[str], timeout_s: float) -> list[str]:
    """The metrics texts of the sidecars at ``host:port`` ``addresses`` that answered 200."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # trust_env=False: pod-to-pod traffic must never go through an HTTP(S)_PROXY.
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        texts = await asyncio.gather(
            *(_get(session, f"http://{a}{METRICS_PATH}") for a in addresses)
        )
    return [text for text in texts if text is not None]


async def _get(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url) as resp:
            return await resp.text() if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None
