"""Hot reload: the operator's long-poll first, the config file as the fallback.

With ``$TOKENFAIR_CONFIG_URL`` set (the injector sets it), a :class:`~.config_feed.RemoteFeed`
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
import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from tokenfair.config import Config, ConfigError, read_config_file
from tokenfair.config.budget_store import split_budgets
from tokenfair.config.files import InputFileError, read_regular
from tokenfair.config.wire import GENERATION_FILE
from tokenfair.server.auth import Authenticator
from tokenfair.server.backends import CostModelBackend, default_max_in_flight
from tokenfair.server.config_feed import RemoteFeed, RemoteSource, parse_generation
from tokenfair.server.runtime_settings import LoadedFile, loads_sidecar_file

if TYPE_CHECKING:
    from tokenfair.server.pool import BudgetPool
    from tokenfair.server.sidecar import Sidecar

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


# -- the reload plan: what a running sidecar adopts of a new document ------------------------


def apply_config(sidecar: Sidecar, loaded: LoadedFile) -> None:
    """Adopt a valid new config: queued and running requests keep going. A document whose
    budget store this sidecar cannot honour until a restart is enforced as it can
    (:func:`enforceable`) or refused (the last good config stays)."""
    config = loaded.config
    enforced, notice = enforceable(sidecar.pool, config)
    if enforced is None:
        sidecar.budget_store_notice = notice
        refuse_config(sidecar, notice)
        return
    sidecar.engine_link.enforce(enforced)
    if sidecar.pool is not None:
        sidecar.pool.adopt(enforced)
    if sidecar.pool_fairness is not None and enforced.budget_store is not None:
        sidecar.pool_fairness.adopt(enforced.budget_store)
        present = {tenant.tenant_id for tenant in config.tenants}
        before = {tenant.tenant_id for tenant in sidecar.config.tenants}
        sidecar.pool_fairness.forget(before - present, present)
    if notice:
        log.warning("config reload: %s", notice)
    sidecar.budget_store_notice = notice
    sidecar.auth = Authenticator(config, sidecar.settings.trusted_tenant_header)
    if isinstance(sidecar.backend, CostModelBackend):
        sidecar.backend.retune(sidecar.scheduler.cost)  # the policy's, as the scheduler prices
    if not sidecar.settings.max_in_flight:  # the default follows maxBatchRequests
        sidecar.dispatcher.max_in_flight = default_max_in_flight(sidecar.backend, enforced.policy)
    sidecar.config = config
    sidecar.config_sha256 = loaded.sha256
    sidecar.fairness.reconfigure(config)
    sidecar.demand.retune(
        (enforced.policy.max_interactive_wait_ms, enforced.policy.max_batch_wait_ms),
        sidecar.scheduler.cost.service_tokens_per_ms,
    )
    sidecar.metrics.reloads.labels("applied").inc()
    if loaded.section != sidecar.section:
        log.warning("config reload: the sidecar: section changed; restart to apply it")
    log.info("config reloaded: version %r, sha256 %s", config.version, loaded.sha256[:12])
    sidecar.dispatcher.pump()


def enforceable(pool: BudgetPool | None, config: Config) -> tuple[Config | None, str]:
    """What of ``config`` a sidecar running ``pool`` (None: started without a budget store)
    enforces, and why it differs (or "").

    The store's connection (and the lease client) is made at start only, and a document's
    budgets are the pool's with a store but one sidecar's share without one. So:

    * started without a store, the document adds one: its budgets are the pool's, and no
      lease client runs here; each tenant gets ``split_budgets(tenant, replicas)`` (the
      store's fallback split) on a local bucket, until a restart;
    * started with a store, the document removes it: its budgets are one sidecar's share,
      wrong for the running pool; refused (None), the last good config stays;
    * the store's identity (url, passwordEnv, keyPrefix) changes: the budgets are still
      the pool's; the running store keeps serving them (its replicas and lease settings
      follow the document), until a restart;
    * ``fairness`` flips: the fair shares' task is made at start only; the running mode
      (pool-wide or per sidecar) stays, until a restart.
    """
    new = config.budget_store
    if pool is None:
        if new is None:
            return config, ""
        shares = tuple(split_budgets(tenant, new.replicas) for tenant in config.tenants)
        return dataclasses.replace(config, tenants=shares, budget_store=None), (
            f"budgetStore added ({new.url}, key prefix {new.key_prefix!r}) but this sidecar "
            f"started without one: each tenant's pool budget is enforced here as "
            f"1/{new.replicas} on a local bucket until the sidecar is restarted"
        )
    running = pool.store
    if new is None:
        return None, (
            f"budgetStore removed, but this sidecar leases from {running.url} (key prefix "
            f"{running.key_prefix!r}) and the document's budgets are per-sidecar shares; "
            "reload refused, the last good config and its pool stay until the sidecar is "
            "restarted"
        )
    notices: list[str] = []
    if new.fairness != running.fairness:
        notices.append(
            f"budgetStore.fairness changed to {str(new.fairness).lower()}; this sidecar keeps "
            f"fairness: {str(running.fairness).lower()} until it is restarted"
        )
        new = dataclasses.replace(new, fairness=running.fairness)
    identity = (running.url, running.password_env, running.key_prefix)
    if (new.url, new.password_env, new.key_prefix) != identity:
        notices.append(
            f"budgetStore changed to {new.url} (key prefix {new.key_prefix!r}); this sidecar "
            f"keeps leasing from {running.url} (key prefix {running.key_prefix!r}) until it "
            "is restarted"
        )
        new = dataclasses.replace(
            new,
            url=running.url,
            password_env=running.password_env,
            key_prefix=running.key_prefix,
        )
    if not notices:
        return config, ""
    return dataclasses.replace(config, budget_store=new), "; ".join(notices)


def refuse_config(sidecar: Sidecar, message: str) -> None:
    """Count and log a document refused (the last good config stays)."""
    sidecar.metrics.reloads.labels("invalid").inc()
    log.error("config reload refused, keeping the last good config: %s", message)


def reload_failed(sidecar: Sidecar, message: str) -> None:
    """Count a reload that failed unexpectedly (the watcher logged it, with its traceback,
    and tries again on its next tick)."""
    sidecar.metrics.reloads.labels("error").inc()
