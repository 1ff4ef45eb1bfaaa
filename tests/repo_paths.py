"""Where things are, for tests in any folder: the repository's root and the tests' data."""

from __future__ import annotations

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
"""``tests/``: the support modules (on pytest's ``pythonpath``) and ``data/``."""
REPO_ROOT = TESTS_DIR.parent
TEST_DATA = TESTS_DIR / "data"
