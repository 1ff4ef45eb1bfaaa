"""Shared pytest configuration: fixture plugins and the guard against leaked asyncio tasks."""

from __future__ import annotations

pytest_plugins = ["kubecluster"]
