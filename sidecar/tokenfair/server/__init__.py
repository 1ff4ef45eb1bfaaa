"""The sidecar server: an aiohttp proxy enforcing the scheduling core on live traffic."""

from __future__ import annotations

from tokenfair.server.admin import create_admin_app
from tokenfair.server.app import SIDECAR, create_app
from tokenfair.server.backends import Backend, make_backend
from tokenfair.server.runtime_settings import (
    LoadedFile,
    SidecarSettings,
    load_sidecar_file,
    settings_from_section,
)
from tokenfair.server.sidecar import Sidecar

__all__ = [
    "SIDECAR",
    "Backend",
    "LoadedFile",
    "Sidecar",
    "SidecarSettings",
    "create_admin_app",
    "create_app",
    "load_sidecar_file",
    "make_backend",
    "settings_from_section",
]
