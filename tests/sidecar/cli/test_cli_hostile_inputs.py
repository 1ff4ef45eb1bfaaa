"""Hostile input files given to the CLI, as a user runs it (the console script, real files;
issue 28, row 8).

Every command that reads records (``report --records``, ``calibrate --records``, ``simulate
--trace``, ``loadgen --trace``) and every one that reads a config (``simulate --tenants``,
``trace generate --tenants``, ``loadgen --keys``), given a file that is

* a line nested 200,000 deep (``[[[…]]]``; a YAML/JSON config nested as deep),
* ``/dev/zero`` (through a symlink),
* a FIFO nobody writes,
* a huge line (100 MB without a newline; a 100 MB config),
* binary bytes,

prints exactly one line on stderr, ``tokenfair <command>: error: <file>…: <rule>``, and exits 2,
within a bounded time (each run has 60 s, a FIFO or ``/dev/zero`` used to hang) and memory (a
2 GiB address-space limit: reading ``/dev/zero`` or a 100 MB line whole used to fill it and end
in a ``MemoryError`` traceback). The 100 MB files are sparse: they take no disk.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

TOKENFAIR = str(Path(sys.executable).parent / "tokenfair")
EXAMPLE = REPO_ROOT / "examples" / "sidecar-standalone.yaml"
MEMORY_LIMIT_BYTES = 2 << 30
RUN_BUDGET_S = 60.0
DEPTH = 200_000
HUGE_BYTES = 100_000_000


def limited_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def deep(path: Path) -> None:
    path.write_text("[" * DEPTH + "]" * DEPTH + "\n")


def zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def fifo(path: Path) -> None:
    os.mkfifo(path)


def huge(path: Path) -> None:
    with path.open("wb") as handle:  # sparse: NUL bytes, no newline, no disk
        handle.truncate(HUGE_BYTES)


def binary(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 64)


KINDS: dict[str, Callable[[Path], None]] = {
    "deep": deep,
    "zero": zero,
    "fifo": fifo,
    "huge": huge,
    "binary": binary,
}
RECORD_RULES: dict[str, str | tuple[str, ...]] = {
    "deep": "JSON nested too deeply (a record is one flat JSON object)",
    "zero": "must be a regular file (it is a character device)",
    "fifo": "must be a regular file (it is a FIFO)",
    "huge": "a line longer than 1048576 bytes (1 MiB)",
    "binary": ("invalid JSON", "not UTF-8 text"),
}
CONFIG_RULES = {
    "deep": "invalid YAML: nested too deeply",
    "zero": "must be a regular file (it is a character device)",
    "fifo": "must be a regular file (it is a FIFO)",
    "huge": "must be at most 16777216 bytes (16 MiB)",
    "binary": "invalid YAML",
}
RECORD_READERS = {
    "report": ["report", "--records", "{file}"],
    "calibrate": ["calibrate", "--no-progress", "--records", "{file}"],
    "simulate": ["simulate", "--no-progress", "--tenants", str(EXAMPLE), "--trace", "{file}"],
    "loadgen": ["loadgen", "--no-progress", "--target", "http://127.0.0.1:9", "--trace", "{file}"],
}  # fmt: skip
CONFIG_READERS = {
    "simulate": ["simulate", "--no-progress", "--scenario", "noisy-neighbor",
                 "--tenants", "{file}"],
    "trace": ["trace", "generate", "--tenants", "{file}", "--requests", "10"],
    "loadgen": ["loadgen", "--no-progress", "--target", "http://127.0.0.1:9",
                "--scenario", "noisy-neighbor", "--keys", "{file}"],
}  # fmt: skip


def run(argv: list[str], file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TOKENFAIR, *(arg.replace("{file}", str(file)) for arg in argv)],
        capture_output=True, text=True, timeout=RUN_BUDGET_S, preexec_fn=limited_memory,
    )  # fmt: skip


def assert_one_line(done: subprocess.CompletedProcess[str], command: str, file: Path,
                    rule: str | tuple[str, ...]) -> None:  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"tokenfair {command}: error: "), lines[0]
    assert str(file) in lines[0]
    rules = (rule,) if isinstance(rule, str) else rule
    assert any(one in lines[0] for one in rules), lines[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", RECORD_READERS)
def test_hostile_records_are_one_line_and_exit_2(tmp_path: Path, command: str, kind: str) -> None:
    file = tmp_path / f"records-{kind}.jsonl"
    KINDS[kind](file)
    assert_one_line(run(RECORD_READERS[command], file), command, file, RECORD_RULES[kind])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", CONFIG_READERS)
def test_hostile_configs_are_one_line_and_exit_2(tmp_path: Path, command: str, kind: str) -> None:
    file = tmp_path / f"config-{kind}.yaml"
    KINDS[kind](file)
    rule = CONFIG_RULES[kind]
    if command == "loadgen" and kind in ("binary",):
        rule = "not UTF-8 text"
    assert_one_line(run(CONFIG_READERS[command], file), command, file, rule)


def test_a_deep_line_within_the_line_bound_is_named_too(tmp_path: Path) -> None:
    """An object nested 100,000 deep is 500 KB: read whole, refused by its depth."""
    file = tmp_path / "records.jsonl"
    file.write_text('{"a":' * 100_000 + "1" + "}" * 100_000 + "\n")
    for command in ("report", "calibrate", "simulate"):
        done = run(RECORD_READERS[command], file)
        assert_one_line(done, command, file, ("nested too deeply", "unknown field(s) a"))
