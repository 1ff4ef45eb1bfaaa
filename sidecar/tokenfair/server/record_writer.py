"""Request records: the sidecar's records file, one JSONL line per request that reached admission.

The line is encoded by :mod:`tokenfair.records.live` (the records' contract package: one schema
and one encoder, shared with ``tokenfair simulate --records`` and loadgen), so
``tokenfair simulate --trace FILE`` replays the recorded traffic as it is. Times are model
milliseconds since the sidecar started. This module writes the lines.

Writes are buffered and flushed once per event-loop iteration (``loop.call_soon``), so one
``write(2)`` covers every request finished in that iteration rather than one per line; a crash
loses at most the records of the iteration it happened in. ``close`` flushes what is left.

A write that fails (``ENOSPC``, ``EIO``, ...) never stops the writer: the records not written
stay in memory, at most :data:`MAX_PENDING_RECORDS` of them (a few MiB), and are written when a
retry succeeds (every :data:`RETRY_INTERVAL_S`); records that arrive while that many wait are
dropped and counted (``tokenfair_records_dropped_total``). A line cut by a partial write is
completed first, so the file never holds half a record followed by another. The failure is
logged once when it starts and once when writing works again.

The path must name a regular file (or nothing yet: it is created); a FIFO, a device or a
directory is refused at start (:mod:`tokenfair.config.files`). :meth:`RecordWriter.reopen`
opens it anew after log rotation (the sidecar calls it on ``SIGHUP``:
:meth:`Sidecar.reopen_logs <tokenfair.server.sidecar.Sidecar.reopen_logs>`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final, Protocol

from tokenfair.config.files import open_regular

MAX_PENDING_RECORDS: Final = 10_000
"""Records kept in memory while the file refuses writes (~500 bytes each: ~5 MiB); beyond it
new records are dropped and counted rather than growing the process without bound."""
RETRY_INTERVAL_S: Final = 1.0
"""How often a failing records file is tried again (a full disk frees up in seconds at best)."""

log = logging.getLogger("tokenfair.sidecar")


class RecordSink(Protocol):
    """What the writer needs of its file: an unbuffered binary file (``open(..., "ab",
    buffering=0)``), whose ``write`` says how many bytes it took."""

    @property
    def closed(self) -> bool: ...

    def write(self, data: bytes, /) -> int | None: ...

    def close(self) -> None: ...


class RecordWriter:
    """Appends records to a JSONL file (opened and closed by the app's cleanup context).

    ``write`` queues an encoded line (:func:`tokenfair.records.live.encode_record`); one flush
    per event-loop iteration writes the queued lines together (outside a running loop, at
    once). If the file refuses a write, the lines wait (bounded, see the module docstring) and
    are retried.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_pending: int = 0,
        retry_interval_s: float = 0.0,
        on_dropped: Callable[[int], object] | None = None,
    ) -> None:
        # Unbuffered: a failed or partial write(2) is seen here, not hidden in a buffer.
        # Held open for the app's lifetime; the cleanup context closes it. A regular file
        # only: a FIFO would block the open (and every write) until a reader came.
        file = open_regular(path, append=True)
        self._init(file, str(path), max_pending, retry_interval_s, on_dropped, path)

    @classmethod
    def to_file(
        cls,
        file: RecordSink,
        name: str = "<records>",
        *,
        max_pending: int = 0,
        retry_interval_s: float = 0.0,
        on_dropped: Callable[[int], object] | None = None,
    ) -> RecordWriter:
        """A writer on an open binary file (``write`` returning the bytes written)."""
        writer = cls.__new__(cls)
        writer._init(file, name, max_pending, retry_interval_s, on_dropped, None)
        return writer

    def _init(
        self,
        file: RecordSink,
        name: str,
        max_pending: int,
        retry_interval_s: float,
        on_dropped: Callable[[int], object] | None,
        path: str | Path | None,
    ) -> None:
        self._file = file
        self.name = name
        self.path = path
        """Where :meth:`reopen` opens the file again (None: a file handed to :meth:`to_file`)."""
        self.max_pending = max_pending or MAX_PENDING_RECORDS
        self.retry_interval_s = retry_interval_s or RETRY_INTERVAL_S
        self._on_dropped = on_dropped
        self._pending: list[str] = []
        self._partial = b""
        """The rest of a line a partial write began: written before anything else."""
        self._scheduled: asyncio.Handle | None = None
        self._failure: str | None = None
        """Why writes fail, while they do (logged once at the start, once at the end)."""
        self.dropped = 0
        """Records dropped (the pending buffer was full, or the writer closed failing)."""

    def write(self, line: str) -> None:
        """Queue one record's JSON text (one line, without the newline)."""
        pending = self._pending
        if len(pending) >= self.max_pending:
            self._drop(1)
            return
        pending.append(line)
        if self._scheduled is None:
            try:
                self._scheduled = asyncio.get_running_loop().call_soon(self._scheduled_flush)
            except RuntimeError:  # no loop running: write through
                self.flush()

    def _scheduled_flush(self) -> None:
        self._scheduled = None
        if not self.flush() and not self._file.closed:
            self._scheduled = asyncio.get_running_loop().call_later(
                self.retry_interval_s, self._scheduled_flush
            )

    def flush(self) -> bool:
        """Write what is queued; False if the file refused (the lines wait for a retry)."""
        if self._file.closed:
            return False
        lines, self._pending = self._pending, []
        partial = self._partial
        if not lines and not partial:
            return True
        data = partial + ("\n".join(lines) + "\n").encode("utf-8") if lines else partial
        written = 0
        try:
            while written < len(data):
                count = self._file.write(data[written:])
                if not count:  # a file that takes nothing and says nothing: try again later
                    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
                written += count
        except OSError as exc:
            self._keep(data, written, bool(partial))
            if self._failure is None:
                self._failure = exc.strerror or str(exc)
                log.error(
                    "records file %s: write failed (%s); keeping up to %d records in memory, "
                    "retrying every %g s", self.name, self._failure, self.max_pending,
                    self.retry_interval_s,
                )  # fmt: skip
            return False
        self._partial = b""
        if self._failure is not None:
            log.warning("records file %s: writing again after %s (%d records dropped so far)",
                        self.name, self._failure, self.dropped)  # fmt: skip
            self._failure = None
        return True

    def _keep(self, data: bytes, written: int, had_partial: bool) -> None:
        """Keep the unwritten bytes of ``data``: the rest of a line a write cut (to be written
        first) and the whole lines after it (back in the queue, ahead of newer ones)."""
        rest = data[written:]
        mid_line = data[written - 1] != 0x0A if written else had_partial
        cut = rest.find(b"\n") + 1 if mid_line else 0
        self._partial = rest[:cut]
        whole = rest[cut:].decode("utf-8").split("\n")[:-1]
        self._pending[:0] = whole
        excess = len(self._pending) - self.max_pending
        if excess > 0:  # cannot happen (write() bounds the queue), but the bound is the bound
            del self._pending[self.max_pending :]
            self._drop(excess)

    def _drop(self, count: int) -> None:
        self.dropped += count
        if self._on_dropped is not None:
            self._on_dropped(count)

    def reopen(self) -> bool:
        """Open the records path anew, for log rotation: after ``logrotate`` renamed the file
        (and before its ``postrotate`` SIGHUP), records go on into a new file at the path, the
        renamed one keeping what was written to it. What is queued is written to the old file
        first; the rest of a line a failed write cut there is dropped (its head is in the old
        file) and counted. If the path cannot be opened (no longer a regular file, no
        permission), the writer keeps the file it has, and says so. True if reopened; a
        writer on a file it did not open (:meth:`to_file`) has nothing to reopen. Never
        raises."""
        if self.path is None or self._file.closed:
            return False
        self.flush()
        try:
            fresh = open_regular(self.path, append=True)
        except (OSError, ValueError) as exc:
            log.error("records file %s: cannot reopen (%s); still writing to the file it had",
                      self.name, exc)  # fmt: skip
            return False
        if self._partial:
            self._partial = b""
            self._drop(1)
        old, self._file = self._file, fresh
        try:
            old.close()
        except OSError as exc:  # its last bytes were written (or kept) above
            log.warning("records file %s: closing the old file failed (%s)", self.name, exc)
        log.info("records file %s reopened", self.name)
        return True

    def close(self) -> None:
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None
        if not self.flush() and not self._file.closed:
            lost = len(self._pending)
            self._pending.clear()
            self._drop(lost)
            log.error("records file %s: closed while writes fail; %d records lost",
                      self.name, lost)  # fmt: skip
        self._file.close()
