"""Hot reload: the operator's long-poll first, the config file as the fallback.

With ``$TOKENFAIR_CONFIG_URL`` set (the injector sets it), a :class:`~.remote.RemoteFeed`
long-polls the operator for the document and hands each new one to :meth:`ConfigWatcher.offer`:
applied within about a second of the operator storing it. While that feed is healthy the file
is not read (the kubelet refreshes it up to ~60 s late and could briefly bring back an older
version); when the operator is unreachable the file is polled as before. Either way an invalid
document is refused and the last good config stays, and bytes already applied (the same
document arriving by the other path) are recognised by their SHA-256 and skipped.

**Never backwards.** The operator numbers each policy's documents with a generation that only
grows (header ``X-Tokenfair-Config-Generation`` on the long-poll, file ``generation`` beside
the mounted ``config.yaml``: a data key of the same ConfigMap/Secret). The watcher remembers
the generation it runs and refuses a document of a lower one, from either path (``refuse``:
a log line and ``tokenfair_config_reloads_total{result="invalid"}``): a replica serving its
previous term's document, or a file the kubelet has not refreshed yet when the long-poll
fails, cannot take a sidecar back. A document without a generation counts as 0 (a standalone
file: nothing to compare, all applies as before). The generation file is read before and after
the config; if they differ the kubelet swapped the volume in between, and the next tick reads
again.

Every ``reload_interval_s`` the file's ``(mtime_ns, ctime_ns, size, inode)`` is compared with the
last one read successfully; on a change its bytes are hashed, and a new SHA-256 is parsed. A valid
document is applied (``scheduler.reconfigure``: queued and running requests stay); an invalid one
is refused (``refuse``: logged, counted in ``tokenfair_config_reloads_total{result="invalid"}``)
and the last good config stays. A vanished or unreadable file is an invalid change, and so is
a path that names no regular file (a FIFO, a device such as ``/dev/zero``, a directory) or a
file over ``MAX_DOCUMENT_BYTES``: both are refused without being read
(:mod:`tokenfair.config.files`), so no path can block the event loop or fill memory. The
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
from typing import Final, Literal

from tokenfair.config import ConfigError, read_config_file
from tokenfair.config.files import InputFileError, read_regular
from tokenfair.config.wire import GENERATION_FILE
from tokenfair.server.remote import RemoteFeed, RemoteSource, parse_generation
from tokenfair.server.runtime_settings import LoadedFile, loads_sidecar_file

log = logging.getLogger("tokenfair.sidecar")

Report = Callable[[str], None]
MAX_GENERATION_BYTES: Final = 4096
"""Largest generation file read (a number)."""


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
        self.generation = self._initial_generation()
        """The generation of the document that runs (0: none known)."""

    @property
    def generation_path(self) -> Path:
        return self.path.parent / GENERATION_FILE

    def _initial_generation(self) -> int:
        """The file's generation if the file still holds what runs; else 0, and the file is
        read again on the next tick (it changed since it was loaded)."""
        try:
            before = self._file_generation()
            digest = hashlib.sha256(read_config_file(self.path)).hexdigest()
            after = self._file_generation()
        except (ConfigError, OSError, RuntimeError):
            return 0
        if before != after or digest != self.last_sha256:
            self.last_seen = None
            return 0
        return after or 0

    def _file_generation(self) -> int | None:
        """The generation file's number; None without one (OSError, RuntimeError: unreadable
        or not a number)."""
        try:
            text = read_regular(self.generation_path, MAX_GENERATION_BYTES).decode("ascii")
        except FileNotFoundError:
            return None
        except InputFileError as exc:
            raise RuntimeError(str(exc)) from None
        except UnicodeDecodeError:
            raise RuntimeError(f"{self.generation_path}: not a number") from None
        return parse_generation(text)

    def _stat_key(self) -> tuple[int, ...] | None:
        try:
            stat = self.path.stat()
        except OSError:
            return None
        key: tuple[int, ...] = (stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size, stat.st_ino)
        try:  # the generation file too: it may change alone (not in a kubelet's volume)
            other = self.generation_path.stat()
        except OSError:
            return key
        return (*key, other.st_mtime_ns, other.st_ctime_ns, other.st_size, other.st_ino)

    def _older(self, generation: int, source: str) -> bool:
        """Refuse (report) a document older than the one running; True if refused."""
        if generation >= self.generation:
            return False
        message = (
            f"{source}: generation {generation} is older than the running generation "
            f"{self.generation} (a stale operator replica, or a file not refreshed yet); "
            "refused, never going back"
        )
        self._report(message, self.refuse)
        return True

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

    def offer(self, data: bytes, source: str, generation: int | None = None) -> None:
        """A document from elsewhere (the long-poll) of ``generation`` (None: 0): applied
        unless it is what runs already, older than what runs, or invalid (refused, reported,
        the last good config stays); never raises."""
        try:
            number = generation or 0
            digest = hashlib.sha256(data).hexdigest()
            if digest == self.last_sha256:
                self.generation = max(self.generation, number)
                return
            if self._older(number, source):
                return
            try:
                loaded = loads_sidecar_file(data, source)
            except ConfigError as exc:
                self._report(str(exc), self.refuse)
                return
            self.apply(loaded)
            self.last_sha256 = digest
            self.generation = number
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
            path.stat()
        except OSError as exc:
            self.last_seen = None
            self._report(f"{path}: cannot read ({os.strerror(exc.errno or 0)})", self.refuse)
            return
        seen = self._stat_key()
        if seen is None or seen == self.last_seen:
            return
        try:
            before = self._file_generation()
            data = read_config_file(path)
            after = self._file_generation()
        except OSError as exc:  # not marked as seen: read again on the next tick
            self._report(f"{path}: cannot read ({os.strerror(exc.errno or 0)})", self.refuse)
            return
        except ConfigError as exc:  # no regular file, too large: as unreadable
            self._report(str(exc), self.refuse)
            return
        except RuntimeError as exc:  # a generation file that is not a number
            self.last_seen = seen
            self._report(str(exc), self.refuse)
            return
        if before != after:  # swapped between the reads: which config goes with which?
            return  # not marked as seen: the next tick reads both again
        generation = after or 0
        digest = hashlib.sha256(data).hexdigest()
        if digest == self.last_sha256:
            self.last_seen = seen
            self.generation = max(self.generation, generation)
            self._reported = None
            return
        if self._older(generation, str(path)):
            self.last_seen = seen  # only a change of the file is worth another look
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
        self.generation = generation
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
        feed = RemoteFeed(
            remote, lambda data, version, generation: watcher.offer(data, remote.url, generation)
        )
        watcher.defer = feed.healthy
    async with asyncio.TaskGroup() as tasks:
        if feed is not None:
            tasks.create_task(feed.run(), name="tokenfair-config-long-poll")
        while True:
            await asyncio.sleep(interval_s)
            watcher.tick()
