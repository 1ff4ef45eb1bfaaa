"""How a rendered config document is stored in its ConfigMap and Secret: plain or gzip, bounded.

The API server refuses a ConfigMap or Secret whose data (keys and values together) exceeds
:data:`MAX_OBJECT_DATA_BYTES` (1 MiB; etcd's request limit is only a little higher). A document
of 10,000 tenants is ~2.3 MB as JSON, so:

* a document of at most :data:`COMPRESS_ABOVE_BYTES` (256 KiB, ~1,100 tenants) is stored as
  UTF-8 text (``kubectl get cm -o yaml`` shows it, ``data`` for a ConfigMap);
* a larger one is stored gzip-compressed (``binaryData`` for a ConfigMap, still one key, the
  same file name in the sidecar's volume). API-key digests are random hex and compress to about
  half; the rest compresses ~10x: 10,000 tenants with one key each take ~440 KB, so one object
  holds about 23,000 such tenants. The sidecar recognises gzip by its magic bytes
  (``tokenfair.config.document_text``);
* a payload still over the limit is not written: the policy reports ``ConfigPublished=False``,
  reason ``DocumentTooLarge``, naming the size and the limit, and the sidecars keep the last
  document published.

Compression, not sharding, because one object keeps the update atomic (a sidecar never sees half
of a new document) and the mount a single file; ``docs/operator.md`` gives the capacity.
"""

from __future__ import annotations

import gzip
from typing import Final

MAX_OBJECT_DATA_BYTES: Final = 1024 * 1024
"""The API server's limit on one ConfigMap's or Secret's data, keys included (1 MiB)."""
COMPRESS_ABOVE_BYTES: Final = 256 * 1024
"""Documents longer than this (UTF-8 bytes) are stored gzip-compressed."""
GZIP_LEVEL: Final = 6
"""zlib's default: level 9 saves under 1 % more on these documents at twice the time."""


def pack(text: str) -> bytes:
    """The bytes stored for document ``text``: UTF-8, or gzip of it when longer than
    :data:`COMPRESS_ABOVE_BYTES`. Deterministic (no timestamp in the gzip header), so an
    unchanged document packs to the same bytes and the operator writes nothing."""
    raw = text.encode()
    if len(raw) <= COMPRESS_ABOVE_BYTES:
        return raw
    return gzip.compress(raw, GZIP_LEVEL, mtime=0)


def is_text(payload: bytes) -> bool:
    """True when ``payload`` is stored as text (``data``), False for gzip (``binaryData``)."""
    return not payload.startswith(b"\x1f\x8b")


def oversize(key: str, payload: bytes, what: str) -> str | None:
    """Why ``payload`` under ``key`` cannot be stored in one object, or None if it fits."""
    size = len(key.encode()) + len(payload)
    if size <= MAX_OBJECT_DATA_BYTES:
        return None
    return (
        f"the {what} document takes {size} bytes compressed, over the {MAX_OBJECT_DATA_BYTES}-"
        "byte limit of one Kubernetes object; split the tenants across more SchedulingPolicies"
    )
