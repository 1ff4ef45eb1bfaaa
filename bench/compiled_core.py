"""Imported first by a bench that runs the core in its own process: switches the compiled core
on, as the ``tokenfair`` command does at its start (docs/native.md), so that a bench times and
runs what a user runs. A bench that only starts ``tokenfair`` subprocesses does not need it.

``import compiled_core`` sorts among the third-party imports, so it comes before every
``tokenfair`` import of the bench (``ruff``'s isort places first-party imports last)."""

from tokenfair import native

native.activate()
