"""Subcommands of ``tokenfair``; each module has ``register(subparsers)``."""

from __future__ import annotations

from types import ModuleType
from typing import Final

from tokenfair_sidecar.commands import calibrate, loadgen, report, sidecar, simulate, trace

COMMANDS: Final[tuple[ModuleType, ...]] = (
    simulate,
    loadgen,
    trace,
    calibrate,
    report,
    sidecar,
)
