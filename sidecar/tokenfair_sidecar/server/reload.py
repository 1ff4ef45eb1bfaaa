"""Hot reload: poll the config file and apply valid changes to the running sidecar.

Every ``reload_interval_s`` the file's ``(mtime_ns, size)`` is compared with the last seen; on a
change its bytes are hashed, and a new SHA-256 is parsed. A valid document is applied
(``scheduler.reconfigure``: queued and running requests stay); an invalid one is logged and
counted (``tokenfair_config_reloads_total{result="invalid"}``) and the last good config stays.
A vanished file is an invalid change. The ``sidecar:`` section is not reloaded (restart).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from tokenfair_sidecar.config import ConfigError
from tokenfair_sidecar.server.settings import LoadedFile, loads_sidecar_file

log = logging.getLogger("tokenfair.sidecar")


async def watch_config(
    path: Path,
    interval_s: float,
    current_sha256: str,
    apply: Callable[[LoadedFile], None],
    refuse: Callable[[str], None],
) -> None:
    """Run until cancelled."""
    last_seen: tuple[int, int] | None = None
    try:
        stat = path.stat()
        last_seen = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        pass
    last_sha256 = current_sha256
    while True:
        await asyncio.sleep(interval_s)
        try:
            stat = path.stat()
        except OSError as exc:
            if last_seen is not None:
                last_seen = None
                refuse(f"{path}: cannot read ({os.strerror(exc.errno or 0)})")
            continue
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen == last_seen:
            continue
        last_seen = seen
        try:
            data = path.read_bytes()
        except OSError as exc:
            refuse(f"{path}: cannot read ({exc.strerror})")
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest == last_sha256:
            continue
        last_sha256 = digest
        try:
            loaded = loads_sidecar_file(data, str(path))
        except ConfigError as exc:
            refuse(str(exc))
            continue
        apply(loaded)
