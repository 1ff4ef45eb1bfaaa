"""Hot reload: the operator's long-poll first, the config file as the fallback.

With ``$TOKENFAIR_CONFIG_URL`` set (the injector sets it), a :class:`~.remote.RemoteFeed`
long-polls the operator for the document and hands each new one to :meth:`ConfigWatcher.offer`:
applied within about a second of the operator storing it. While that feed is healthy the file
is not read (the kubelet refreshes it up to ~60 s late and could briefly bring back an older
version); when the operator is unreachable the file is polled as before. Either way an invalid
document is refused and the last good config stays, and bytes already applied (the same
document arriving by the other path) are recognised by their SHA-256 and skipped.

Every ``reload_interval_s`` the file's ``(mtime_ns, ctime_ns, size, inode)`` is compared with the
last one read successfully; on a change its bytes are hashed, and a new SHA-256 is parsed. A valid
document is applied (``scheduler.reconfigure``: queued and running requests stay); an invalid one
is refused (``refuse``: logged, counted in ``tokenfair_config_reloads_total{result="invalid"}``)
and the last good config stays. A vanished or unreadable file is an invalid change. The
``sidecar:`` section is not reloaded (restart).

The watcher survives anything: an unexpected exception while reading, parsing or applying is
logged with its traceback and counted through ``fail``
(``tokenfair_config_reloads_total{result="error"}``), and the file is tried again on the next
tick. A failure that repeats tick after tick (an unreadable file, an
apply that keeps failing) is reported once, until it changes or a reload succeeds, so a stuck
file costs one log line rather than one per second. Nothing that failed is marked as seen: a
permission fixed with ``chmod`` (which does not change the mtime) is picked up on the next tick.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from tokenfair_sidecar.config import ConfigError
from tokenfair_sidecar.server.remote import RemoteFeed, RemoteSource
from tokenfair_sidecar.server.settings import LoadedFile, loads_sidecar_file

log = logging.getLogger("tokenfair.sidecar")

Report = Callable[[str], None]


class ConfigWatcher:
    """The state of the watch between ticks; :meth:`tick` never raises."""

    def __init__(
        self,
        path: Path,
        current_sha256: str,
        apply: Callable[[LoadedFile], None],
        refuse: Report,
        fail: Report,
        defer: Callable[[], bool] = lambda: False,
    ) -> None:
        self.path = path
        self.defer = defer
        """True while another source (the long-poll) is authoritative: the file waits."""
        self.apply = apply
        self.refuse = refuse
        self.fail = fail
        self.last_sha256 = current_sha256
        self.last_seen = self._stat_key()
        self._reported: str | None = None
        """The failure reported last; the same one is not reported again until cleared."""

    def _stat_key(self) -> tuple[int, int, int, int] | None:
        try:
            stat = self.path.stat()
        except OSError:
            return None
        return (stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size, stat.st_ino)

    def _report(self, message: str, report: Report) -> None:
        if message != self._reported:
            self._reported = message
            report(message)

    def tick(self) -> None:
        try:
            self._check()
        except Exception as exc:  # the watcher must outlive any failure
            message = f"config reload of {self.path} failed: {type(exc).__name__}: {exc}"
            if message != self._reported:
                log.error("%s", message, exc_info=exc)  # the traceback once per distinct error
            self._report(message, self.fail)

    def offer(self, data: bytes, source: str) -> None:
        """A document from elsewhere (the long-poll): applied unless it is what runs already
        or invalid (refused, reported, the last good config stays); never raises."""
        try:
            digest = hashlib.sha256(data).hexdigest()
            if digest == self.last_sha256:
                return
            try:
                loaded = loads_sidecar_file(data, source)
            except ConfigError as exc:
                self._report(str(exc), self.refuse)
                return
            self.apply(loaded)
            self.last_sha256 = digest
            self._reported = None
        except Exception as exc:  # as tick(): the feed must outlive any failure
            message = f"config from {source} failed: {type(exc).__name__}: {exc}"
            if message != self._reported:
                log.error("%s", message, exc_info=exc)
            self._report(message, self.fail)

    def _check(self) -> None:
        if self.defer():  # not marked as seen: read once the other source stops answering
            return
        path = self.path
        try:
            stat = path.stat()
        except OSError as exc:
            self.last_seen = None
            self._report(f"{path}: cannot read ({os.strerror(exc.errno or 0)})", self.refuse)
            return
        seen = (stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size, stat.st_ino)
        if seen == self.last_seen:
            return
        try:
            data = path.read_bytes()
        except OSError as exc:  # not marked as seen: read again on the next tick
            self._report(f"{path}: cannot read ({os.strerror(exc.errno or 0)})", self.refuse)
            return
        digest = hashlib.sha256(data).hexdigest()
        if digest == self.last_sha256:
            self.last_seen = seen
            self._reported = None
            return
        try:
            loaded = loads_sidecar_file(data, str(path))
        except ConfigError as exc:
            # This content is refused once; only a change of content is worth another look.
            self.last_seen, self.last_sha256 = seen, digest
            self._report(str(exc), self.refuse)
            return
        self.apply(loaded)  # if it raises, nothing is marked: the next tick tries again
        self.last_seen, self.last_sha256 = seen, digest
        self._reported = None


async def watch_config(
    path: Path,
    interval_s: float,
    current_sha256: str,
    apply: Callable[[LoadedFile], None],
    refuse: Report,
    fail: Report,
    remote: RemoteSource | Literal["env"] | None = "env",
) -> None:
    """Run until cancelled: the long-poll of ``remote`` (by default from the environment,
    :meth:`RemoteSource.from_env`; None: none) and the file poll every ``interval_s``."""
    if remote == "env":
        try:
            remote = RemoteSource.from_env()
        except ValueError as exc:  # a bad URL must not cost the file watch
            log.error("no config long-poll: %s", exc)
            remote = None
    feed: RemoteFeed | None = None
    watcher = ConfigWatcher(path, current_sha256, apply, refuse, fail)
    if remote is not None:
        feed = RemoteFeed(remote, lambda data, version: watcher.offer(data, remote.url))
        watcher.defer = feed.healthy
    async with asyncio.TaskGroup() as tasks:
        if feed is not None:
            tasks.create_task(feed.run(), name="tokenfair-config-long-poll")
        while True:
            await asyncio.sleep(interval_s)
            watcher.tick()
