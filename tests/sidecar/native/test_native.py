"""The compiled core (``tokenfair.native``): used only when fresh, and deciding exactly as the
interpreted core does.

* Freshness: a build is used only if every source digest in its manifest is this
  installation's, for this interpreter's extension suffix, with every module file present; each
  way of failing that is refused with its reason (no compiler needed: the manifest rule is read
  on fake builds). A real build whose manifest names one changed source is not imported by a
  real ``tokenfair`` process, and ``TOKENFAIR_NATIVE=0`` turns a fresh one off.
* Same decisions: ``tokenfair simulate --records`` of the same traces (a built-in scenario; a
  generated trace with recorded usage, tight budgets, batch and interactive tenants; with
  lending on; with tenant limits on a batching engine) under every policy, in a subprocess on
  the compiled core and in one on the interpreted core, write the same bytes, report and
  records.

The tests that need a real build skip without one, and fail instead where CI requires it
(``TOKENFAIR_REQUIRE_NATIVE=1``, set by ``.ci/run``; ``make native`` builds it).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO_ROOT

from tokenfair import native

TOKENFAIR = Path(sys.executable).parent / "tokenfair"
REQUIRED = os.environ.get("TOKENFAIR_REQUIRE_NATIVE") == "1"
SWITCHED_OFF = os.environ.get(native.SWITCH_ENV) == "0"


def _build() -> Path:
    """The real build this process would use; skips (or, where required, fails) without one."""
    files, reason = native.check_build(native.native_dir())
    if files is None:
        if REQUIRED:
            pytest.fail(f"TOKENFAIR_REQUIRE_NATIVE=1 but no usable build: {reason}")
        pytest.skip(f"no compiled core ({reason}; make native)")
    return native.native_dir()


def _run(*args: str | Path, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(TOKENFAIR), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **env},
        check=False,
        timeout=600,
    )


# -- the status of this process ---------------------------------------------------------------


def test_status_says_which_core_this_process_imported() -> None:
    from tokenfair.core import drr
    from tokenfair.sim import simulator

    status = native.status()
    compiled = [m.__file__ or "" for m in (drr, simulator)]
    assert all(name.endswith(".so") for name in compiled) == status.active
    assert all(name.endswith(".py") for name in compiled) == (not status.active)
    assert status.describe().startswith("compiled" if status.active else "interpreted")
    if not status.active:
        assert status.reason  # never silent about why


def test_a_required_build_is_in_use() -> None:
    if SWITCHED_OFF:
        pytest.skip("TOKENFAIR_NATIVE=0: this run tests the interpreted core")
    if not REQUIRED:
        pytest.skip("TOKENFAIR_REQUIRE_NATIVE is not set")
    status = native.status()
    assert status.active, status.reason


def test_the_request_stays_interpreted_for_the_trace_decoder() -> None:
    # Request is a msgspec Struct (trace lines decode straight into it): mypyc cannot compile it.
    from tokenfair.core import request

    assert request.__file__ is not None
    assert request.__file__.endswith(".py")
    assert "tokenfair.core.request" not in native.COMPILED


# -- the freshness rule, on fake builds --------------------------------------------------------


def _fake_build(directory: Path, **changes: Any) -> Path:
    """A build directory whose manifest matches this installation, with ``changes`` applied."""
    suffix = native._suffix()
    modules = {name: name.replace(".", "/") + suffix for name in native.COMPILED}
    for relative in modules.values():
        (directory / relative).parent.mkdir(parents=True, exist_ok=True)
        (directory / relative).write_bytes(b"not a real extension")
    manifest: dict[str, Any] = {
        "format": native.FORMAT,
        "suffix": suffix,
        "modules": modules,
        "sizes": {name: len(b"not a real extension") for name in modules},
        "sources": native.source_digests(),
    }
    manifest.update(changes)
    (directory / native.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    return directory


def test_a_build_of_these_sources_for_this_interpreter_is_fresh(tmp_path: Path) -> None:
    files, reason = native.check_build(_fake_build(tmp_path))
    assert reason == ""
    assert files is not None
    assert set(files) == set(native.COMPILED)
    assert all(path.is_file() for path in files.values())


def test_digests_cover_the_compiled_modules_and_what_they_import() -> None:
    digests = native.source_digests()
    for name in native.COMPILED:
        assert name.removeprefix("tokenfair.").replace(".", "/") + ".py" in digests
    # what mypyc may inline from: the config contract, the core's other modules
    assert {"__init__.py", "core/request.py", "core/errors.py", "core/__init__.py"} <= set(digests)
    assert any(path.startswith("config/") for path in digests)
    source = native.PACKAGE_DIR / "core" / "drr.py"
    assert digests["core/drr.py"] == hashlib.sha256(source.read_bytes()).hexdigest()


def _module_file(name: str) -> Path | None:
    """The source of ``tokenfair.x.y`` (a module or a package), None if not ours."""
    parts = name.split(".")
    if parts[0] != "tokenfair":
        return None
    base = native.PACKAGE_DIR.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_the_digests_cover_everything_the_compiled_modules_import() -> None:
    # Transitively, from each compiled module's import statements (function-level ones too),
    # plus each package's __init__ that importing a module runs.
    pending = list(native.COMPILED)
    seen: set[Path] = set()
    while pending:
        name = pending.pop()
        parts = name.split(".")
        pending += [".".join(parts[:end]) for end in range(1, len(parts))]  # its packages
        file = _module_file(name)
        if file is None or file in seen:
            continue
        seen.add(file)
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                pending += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                pending.append(node.module)
                pending += [f"{node.module}.{alias.name}" for alias in node.names]
    hashed = set(native.source_digests())
    imported = {file.relative_to(native.PACKAGE_DIR).as_posix() for file in seen}
    assert "core/tokenfair.py" in imported  # the walk found the core
    assert "config/__init__.py" in imported  # and what it imports
    assert imported - hashed == set()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"sources": {"core/drr.py": "0" * 64}}, "the sources changed since the build"),
        ({"suffix": ".cpython-39-x86_64-linux-gnu.so"}, "built for another interpreter"),
        ({"format": native.FORMAT + 1}, f"not a format-{native.FORMAT} manifest"),
        ({"modules": {"tokenfair.core.drr": "x.so"}}, "modules missing"),
        ({"sizes": {}}, "not the size it was built at"),  # a truncated or replaced extension
    ],
)
def test_a_build_that_does_not_match_is_refused_with_its_reason(
    tmp_path: Path, change: dict[str, Any], reason: str
) -> None:
    if "sources" in change:
        change = {"sources": {**native.source_digests(), **change["sources"]}}
    files, said = native.check_build(_fake_build(tmp_path, **change))
    assert files is None
    assert reason in said


def test_a_missing_module_file_or_manifest_is_refused(tmp_path: Path) -> None:
    build = _fake_build(tmp_path / "build")
    victim = build / (native.COMPILED[0].replace(".", "/") + native._suffix())
    victim.unlink()
    files, said = native.check_build(build)
    assert files is None
    assert "missing" in said
    assert str(victim) in said
    files, said = native.check_build(tmp_path / "nothing")
    assert files is None
    assert "no build at" in said
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / native.MANIFEST).write_text("{", encoding="utf-8")
    files, said = native.check_build(tmp_path / "broken")
    assert files is None
    assert "unreadable" in said


# -- installing a build (no compiler needed: fake extension files) -----------------------------


def test_a_build_never_removes_what_is_not_a_build(tmp_path: Path) -> None:
    # A directory of ours, with a folder that only looks like a build, and a user's files.
    work, directory = tmp_path / "work", _marked(tmp_path / "native")
    _fake_work(work)
    for name in ("build-my-notes", "build-1-x", "notes"):
        (directory / name).mkdir()
        (directory / name / "precious.txt").write_text("precious", encoding="utf-8")
    for _ in range(3):
        native._install(directory, work, native._suffix(), native.source_digests())
    for name in ("build-my-notes", "build-1-x", "notes"):
        assert (directory / name / "precious.txt").read_text(encoding="utf-8") == "precious"
    assert native.is_build_id("build-1796187407487277449-18065")
    assert not native.is_build_id("build-my-notes")


def test_a_build_never_replaces_a_directory_that_is_not_one(tmp_path: Path) -> None:
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("precious", encoding="utf-8")

    def compiler(*_: object, **__: object) -> None:
        raise AssertionError("compiled before checking the directory")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "run", compiler)  # refused before any compiling
        with pytest.raises(RuntimeError, match="is not a build directory"):
            native.build(occupied)
    assert (occupied / "notes.txt").read_text(encoding="utf-8") == "precious"
    (tmp_path / "a-file").write_text("precious", encoding="utf-8")
    with pytest.raises(RuntimeError, match="is not a build directory"):
        native.build(tmp_path / "a-file")
    done = _run("native", "build", occupied, env={}, cwd=tmp_path)
    assert done.returncode == 1
    assert "is not a build directory" in done.stderr
    assert sorted(p.name for p in occupied.iterdir()) == ["notes.txt"]


def _fake_work(work: Path) -> None:
    """What mypyc leaves in its work folder: an extension per module and the shared library."""
    suffix = native._suffix()
    for name in native.COMPILED:
        file = work / (name.replace(".", "/") + suffix)
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(name.encode())
    (work / f"0123abcd__mypyc{suffix}").write_bytes(b"shared")


def _marked(directory: Path) -> Path:
    native._locked(directory)
    native._claim(directory, mark=True)
    return directory


def test_builds_are_installed_whole_switched_by_the_manifest_and_pruned(tmp_path: Path) -> None:
    work, directory = tmp_path / "work", _marked(tmp_path / "native")
    _fake_work(work)
    (directory / ".staging-build-1-1").mkdir()  # left by a build that died
    (directory / f".{native.MANIFEST}.build-1-1").write_text("{", encoding="utf-8")
    (directory / "build-7-7").mkdir()  # an orphan: renamed, never named by a manifest
    digests = native.source_digests()
    first = native._install(directory, work, native._suffix(), digests)
    # Whatever the times say (a clock stepped back, equal stamps), the build the replaced
    # manifest named is the one kept: not the newest other folder.
    os.utime(directory / str(first["build"]), (0, 0))
    orphan = directory / "build-8-8"
    orphan.mkdir()
    os.utime(orphan, (4_000_000_000, 4_000_000_000))
    second = native._install(directory, work, native._suffix(), digests)
    third = native._install(directory, work, native._suffix(), digests)
    on_disk = json.loads((directory / native.MANIFEST).read_text(encoding="utf-8"))
    assert on_disk == third
    kept = sorted(p.name for p in directory.iterdir() if p.name.startswith("build-"))
    assert kept == sorted([str(second["build"]), str(third["build"])])
    files, reason = native.check_build(directory)
    assert reason == ""
    assert files is not None
    assert set(files) == {*native.COMPILED, "0123abcd__mypyc"}
    build_dir = directory / str(third["build"])
    assert all(path.is_relative_to(build_dir) for path in files.values())
    assert files["tokenfair.core.drr"].read_bytes() == b"tokenfair.core.drr"
    assert not list(directory.glob(".staging-*"))
    assert not list(directory.glob(f".{native.MANIFEST}.*"))


def test_a_build_leaves_its_files_readable_by_all_whatever_the_umask(tmp_path: Path) -> None:
    work = tmp_path / "work"
    _fake_work(work)
    previous = os.umask(0o077)
    try:
        directory = _marked(tmp_path / "native")
        manifest = native._install(directory, work, native._suffix(), native.source_digests())
    finally:
        os.umask(previous)
    build_dir = directory / str(manifest["build"])
    assert directory.stat().st_mode & 0o777 == 0o755
    for entry in [directory / native.MANIFEST, directory / native.MARKER, directory / ".lock"]:
        assert entry.stat().st_mode & 0o777 == 0o644, entry
    for entry in [build_dir, *build_dir.rglob("*")]:
        assert entry.stat().st_mode & 0o777 == (0o755 if entry.is_dir() else 0o644), entry


def test_a_failed_install_leaves_the_current_build_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work, directory = tmp_path / "work", _marked(tmp_path / "native")
    _fake_work(work)
    current = native._install(directory, work, native._suffix(), native.source_digests())
    before = sorted(p.name for p in directory.iterdir())

    def full_disk(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        native._install(directory, work, native._suffix(), native.source_digests())
    monkeypatch.undo()
    assert sorted(p.name for p in directory.iterdir()) == before
    assert json.loads((directory / native.MANIFEST).read_text(encoding="utf-8")) == current


def test_an_interrupt_after_the_switch_keeps_the_build_the_manifest_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work, directory = tmp_path / "work", _marked(tmp_path / "native")
    _fake_work(work)
    native._install(directory, work, native._suffix(), native.source_digests())
    replace = os.replace

    def switched_then_interrupted(source: str | Path, target: str | Path) -> None:
        replace(source, target)
        raise KeyboardInterrupt  # Ctrl-C as `os.replace` returns

    monkeypatch.setattr(os, "replace", switched_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        native._install(directory, work, native._suffix(), native.source_digests())
    monkeypatch.undo()
    files, reason = native.check_build(directory)
    assert reason == ""
    assert files is not None


def test_a_build_id_that_exists_is_never_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work, directory = tmp_path / "work", _marked(tmp_path / "native")
    _fake_work(work)
    monkeypatch.setattr("time.time_ns", lambda: 1_000)  # a clock that does not move
    first = native._install(directory, work, native._suffix(), native.source_digests())
    second = native._install(directory, work, native._suffix(), native.source_digests())
    assert first["build"] != second["build"]
    assert (directory / str(first["build"])).is_dir()  # kept: the manifest it replaced named it
    files, reason = native.check_build(directory)
    assert reason == ""
    assert files is not None


def test_a_build_directory_of_ours_is_rebuilt_into(tmp_path: Path) -> None:
    work, directory = tmp_path / "work", _marked(tmp_path / "native")
    _fake_work(work)
    native._install(directory, work, native._suffix(), native.source_digests())
    native._claim(directory, mark=False)  # not empty, but ours: no error
    # a build made before the marker existed: its manifest says it is ours
    older = tmp_path / "older"
    older.mkdir()
    (older / native.MANIFEST).write_text(
        json.dumps({"format": 1, "suffix": native._suffix(), "sources": {}}), encoding="utf-8"
    )
    native._claim(older, mark=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / native.MANIFEST).write_text('{"name": "x"}', encoding="utf-8")
    with pytest.raises(RuntimeError, match="is not a build directory"):
        native._claim(tmp_path / "other", mark=False)


def test_a_fault_in_the_check_leaves_the_interpreted_core(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(directory: Path) -> tuple[None, str]:
        raise ValueError("a manifest nobody foresaw")

    monkeypatch.setattr(native, "_status", None)
    monkeypatch.setattr(native, "COMPILED", ("tokenfair.core.never_imported",))
    monkeypatch.setattr(native, "check_build", broken)
    monkeypatch.delenv(native.SWITCH_ENV, raising=False)
    finders = list(sys.meta_path)
    status = native.activate()
    assert not status.active
    assert "cannot check the build" in status.reason
    assert "a manifest nobody foresaw" in status.reason
    assert sys.meta_path == finders


# -- a real build, in real processes ------------------------------------------------------------


def _loaded_file(
    env: dict[str, str], cwd: Path, prelude: str = "import tokenfair.native as n; n.activate()"
) -> tuple[str, str]:
    """What a fresh interpreter imports for ``tokenfair.core.drr`` after ``prelude`` (by
    default the entry points' activation), and its native status."""
    script = (
        f"{prelude}; import tokenfair.core.drr as m, tokenfair.native as n; "
        "print(m.__file__); print(n.status().describe())"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **env},
        check=True,
    )
    path, described = done.stdout.splitlines()
    return path, described


def test_only_an_entry_point_activates_the_compiled_core(tmp_path: Path) -> None:
    build = _build()
    env = {native.SWITCH_ENV: "1", native.DIR_ENV: str(build)}
    # `import tokenfair` (or its config, as the operator does) activates nothing
    path, described = _loaded_file(env, tmp_path, prelude="import tokenfair, tokenfair.config")
    assert path.endswith(".py")
    assert native.NOT_ACTIVATED in described
    # activation after a compiled module was imported keeps the process on one core
    late = "import tokenfair.core.bucket; import tokenfair.native as n; n.activate()"
    path, described = _loaded_file(env, tmp_path, prelude=late)
    assert path.endswith(".py")
    assert "activated after tokenfair.core." in described  # the package imports them all
    # the `tokenfair` command activates it (the sidecar runs under it)
    done = _run("native", "status", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout
    assert done.stdout.startswith("compiled")


def test_the_operator_contract_does_not_load_the_native_loader(tmp_path: Path) -> None:
    script = "import sys, tokenfair.config; print('tokenfair.native' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    assert done.stdout.strip() == "False"


def test_a_stale_build_never_runs_and_the_switch_turns_a_fresh_one_off(tmp_path: Path) -> None:
    build = _build()
    path, described = _loaded_file({native.SWITCH_ENV: "1", native.DIR_ENV: str(build)}, tmp_path)
    assert path.endswith(".so")
    assert described.startswith("compiled")
    path, described = _loaded_file({native.SWITCH_ENV: "0", native.DIR_ENV: str(build)}, tmp_path)
    assert path.endswith(".py")
    assert "TOKENFAIR_NATIVE=0" in described
    stale = tmp_path / "stale"
    shutil.copytree(build, stale)
    manifest = json.loads((stale / native.MANIFEST).read_text(encoding="utf-8"))
    manifest["sources"]["core/tokenfair.py"] = "0" * 64  # as if edited since the build
    (stale / native.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    path, described = _loaded_file({native.SWITCH_ENV: "1", native.DIR_ENV: str(stale)}, tmp_path)
    assert path.endswith(".py")
    assert "the sources changed since the build" in described
    done = _run(
        "native", "status", env={native.SWITCH_ENV: "1", native.DIR_ENV: str(stale)}, cwd=tmp_path
    )
    assert done.returncode == 1
    assert "sources changed" in done.stdout


def _trace(path: Path, seed: int, count: int) -> None:
    """Random requests of six tenants (two batch), ~1.5x overload, with recorded usage on
    two thirds of them (refunds and overruns), in (arrival_ms, request_id) order."""
    rng = random.Random(seed)
    lines = []
    arrival_ms = 0.0
    for number in range(count):
        tenant = rng.randrange(6)
        arrival_ms += rng.expovariate(1 / 6.0)
        line: dict[str, Any] = {
            "request_id": f"r{number:06d}",
            "tenant_id": f"t{tenant}",
            "arrival_ms": round(arrival_ms, 3),
            "prefill_tokens": rng.randint(1, 1500),
            "decode_tokens": rng.randint(1, 300),
            "priority_class": "batch" if tenant >= 4 else "interactive",
        }
        if rng.random() < 2 / 3:
            line["actual_prefill_tokens"] = line["prefill_tokens"]
            line["actual_decode_tokens"] = rng.randint(0, 3 * line["decode_tokens"])
        lines.append(json.dumps(line))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _tenants(path: Path, lend: bool, limits: bool = False) -> None:
    """With ``limits``: a batching engine, and tenant limits beside the budgets (t0 and t4 run
    one request at a time, t1 holds at most 8 % of the KV blocks: each holds and expires some)."""
    limit = {0: "\n  maxConcurrentRequests: 1", 4: "\n  maxConcurrentRequests: 1",
             1: "\n  maxKvShare: 0.08"} if limits else {}  # fmt: skip
    tenants = "\n".join(
        f"- tenantId: t{i}\n  weight: {[1, 2, 1.5, 4, 1, 2][i]}\n"
        f"  burstServiceTokens: {[8000, 60000, 20000, 40000, 30000, 12000][i]}\n"
        f"  sustainedServiceTokensPerSecond: {[5000, 120000, 30000, 60000, 20000, 9000][i]}\n"
        f"  priorityClass: {'batch' if i >= 4 else 'interactive'}{limit.get(i, '')}"
        for i in range(6)
    )
    engine = "  maxBatchRequests: 4\n  batchThroughputGain: 2\n" if limits else ""
    path.write_text(
        "apiVersion: tokenfair.io/v1alpha1\nkind: TokenfairConfig\npolicy:\n"
        f"  lendIdleCapacity: {str(lend).lower()}\n  batchMinShare: 0.2\n{engine}"
        f"tenants:\n{tenants}\n",
        encoding="utf-8",
    )


@pytest.mark.parametrize(
    "source",
    ["scenario", "trace", "trace-lending", "trace-limits"],
)
def test_the_compiled_and_interpreted_cores_write_the_same_bytes(
    tmp_path: Path, source: str
) -> None:
    build = _build()
    if source == "scenario":
        args: list[str | Path] = ["--scenario", "noisy-neighbor"]
    else:
        _trace(tmp_path / "trace.jsonl", seed=len(source), count=6000)
        _tenants(
            tmp_path / "tenants.yaml",
            lend=source == "trace-lending",
            limits=source == "trace-limits",
        )
        args = ["--trace", tmp_path / "trace.jsonl", "--tenants", tmp_path / "tenants.yaml"]
    proof = _run(
        "native", "status", env={native.SWITCH_ENV: "1", native.DIR_ENV: str(build)}, cwd=tmp_path
    )
    assert proof.returncode == 0, proof.stdout  # the first run below is on the compiled core
    outputs: dict[str, list[str]] = {}  # by core: simulate json, table, then the reports
    written: dict[str, bytes] = {}  # by core: the records
    for switch in ("1", "0"):
        env = {native.SWITCH_ENV: switch, native.DIR_ENV: str(build)}
        records = tmp_path / f"records-{switch}.jsonl"
        done = _run(
            "simulate", *args, "--records", records, "--format", "json", env=env, cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr
        # The table, and `tokenfair report` over the records (the report modules are compiled
        # too): both cores read the compiled core's records.
        table = _run("simulate", *args, "--format", "table", env=env, cwd=tmp_path)
        assert table.returncode == 0, table.stderr
        reports = []
        tenants: list[str | Path] = (
            [] if source == "scenario" else ["--tenants", tmp_path / "tenants.yaml"]
        )
        windows: list[list[str | Path]] = [[], ["--window", "1000:20000"]]
        for extra in windows:
            for form in ("json", "table"):
                report_run = _run(
                    "report",
                    "--records",
                    tmp_path / "records-1.jsonl",
                    *tenants,
                    *extra,
                    "--format",
                    form,
                    env=env,
                    cwd=tmp_path,
                )
                assert report_run.returncode == 0, report_run.stderr
                reports.append(report_run.stdout)
        outputs[switch] = [done.stdout, table.stdout, *reports]
        written[switch] = records.read_bytes()
    report = json.loads(outputs["1"][0])
    assert set(report["comparison"]) == {
        "request_count_no_admission",
        "service_token_drr_with_admission",
        "tokenfair",
    }
    # one record per request and policy
    assert written["1"].count(b"\n") == sum(
        summary["total_requests"] for summary in report["comparison"].values()
    )
    assert "fairness over" in outputs["1"][1]
    assert all(outputs["1"])
    assert written["1"] == written["0"]
    for compiled, interpreted in zip(outputs["1"], outputs["0"], strict=True):
        assert compiled == interpreted


@pytest.mark.parametrize("engine", [[], ["--set", "maxBatchRequests=8", "--set",
                                          "batchThroughputGain=4", "--set",
                                          "serviceTokensPerMs=53"]])  # fmt: skip
def test_the_pool_replay_is_the_same_on_both_cores(tmp_path: Path, engine: list[str]) -> None:
    # The pool's order and its admission (core/pool_order.py: float sweeps, sorted events, the
    # elsewhere rates) reach no single-replica replay: `simulate --replicas` with the counters
    # shared (+pool), serial and batching, byte for byte.
    build = _build()
    outputs = []
    for switch in ("1", "0"):
        env = {native.SWITCH_ENV: switch, native.DIR_ENV: str(build)}
        done = _run("simulate", "--scenario", "pool-skewed", "--replicas", "4", "--routing",
                    "skewed", *engine, "--format", "json", env=env, cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert '"tokenfair+pool"' in outputs[0]
    assert outputs[0] == outputs[1]


def test_both_cores_bound_the_pool_admission_alike(tmp_path: Path) -> None:
    # Past POOL_WEIGHED_TENANTS backlogged, admission with a store reads the lane's ranking of
    # the counters and its sums (core/pool_order.py `below`, shares.py `RateSum`) and folds the
    # rest into one piece: no pool scenario reaches it more than a few times, so both cores
    # predict here with 300 backlogged at varied counters, weights and rates, bit for bit.
    build = _build()
    script = (
        "from tokenfair.config import PolicyConfig, TenantConfig, build_config\n"
        "from tokenfair.core import Request\n"
        "from tokenfair.core.pool_order import PoolService\n"
        "from tokenfair.core.tokenfair import TokenfairScheduler\n"
        "from tokenfair import native\n"
        "weights = (1.0, 2.0, 0.5)\n"
        "tenants = tuple(TenantConfig(f't{i}', weights[i % 3], 10**9, 10**7, 'interactive')\n"
        "                for i in range(320))\n"
        "policy = PolicyConfig(max_interactive_wait_ms=10.0**5, max_queued_requests=10**6)\n"
        "s = TokenfairScheduler(build_config(policy, tenants))\n"
        "s.share_pool_service(PoolService())\n"
        "now = 0.0\n"
        "for i in range(320):\n"
        "    for k in range(1 + i % 4):\n"
        "        s.submit(Request(f'w{i}.{k}', f't{i}', now, 40 + 97 * (i % 11), 5,\n"
        "                         'interactive'), now)\n"
        "        d = s.next_dispatch(now)\n"
        "        s.complete(d.request_id, now + 2.0)\n"
        "        now += 2.5\n"
        "s.running = 10**6\n"
        "out = []\n"
        "for i in range(300):\n"
        "    d = s.submit(Request(f'q{i}', f't{i}', now, 100 + i % 7, 10, 'interactive'), now)\n"
        "    out.append('.' if d is None else d.reason)\n"
        "for i in range(0, 320, 7):\n"
        "    out.append(s.predicted_wait_ms(f't{i}', 0, 150, now + 1.0).hex())\n"
        "print(native.status().active, len(s._lanes[0].active), ' '.join(out))\n"
    )
    lines = {switch: out.split(" ", 2) for switch, out in _both_cores(script, build, tmp_path)}
    assert lines["1"][0] == "True"
    assert lines["0"][0] == "False"
    assert int(lines["0"][1]) > 32  # past the cap: the bounded path ran
    assert lines["1"][1:] == lines["0"][1:]


INTERPRETED_ONLY = (
    "tests/sidecar/core/test_core_inline_paths.py::test_the_inline_paths_decide_and_end_as_the_reference",
    "tests/sidecar/core/test_core_fast_paths.py::test_the_rounded_occupancy_cache_changes_no_decision",
    "tests/sidecar/core/test_pool_order.py::test_admission_with_a_store_weighs_only_the_backlogged_tenants",
    "tests/sidecar/core/test_pool_order.py::test_admission_with_a_store_is_bounded_at_5000_backlogged[5000]",
    "tests/sidecar/core/test_pool_order.py::test_admission_with_a_store_is_bounded_at_5000_backlogged[10]",
)
"""Tests that skip on the compiled core: reference subclasses of the core's classes (an
interpreted class cannot subclass a compiled one), a patched module constant (the compiled core
has inlined it), methods patched to count calls."""


INTERPRETED_PASS = (
    "tests/sidecar/core",
    "tests/sidecar/server/test_sidecar_lifecycle.py",
    "tests/sidecar/server/test_sidecar_settlement.py",
    "tests/sidecar/server/test_sidecar_app.py",
)
"""What runs a second time on the interpreted core when the suite runs on the compiled one: the
core's own tests and the sidecar's request path, which calls the core's queries that no replay
reaches (``budget``, ``running_backlog``, ``is_running``, ``held_job``, ``release_unsettled``).
The image ships the interpreted core (no C compiler in it); the replay differential above covers
only what ``simulate`` calls. It holds :data:`INTERPRETED_ONLY`, which skip in the compiled run."""


def test_the_core_and_the_request_path_pass_on_the_interpreted_core() -> None:
    if not native.status().active:
        pytest.skip("this run is on the interpreted core: they ran in it")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *INTERPRETED_PASS],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, native.SWITCH_ENV: "0"},
        check=False,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert " passed" in done.stdout, done.stdout[-4000:]  # the return code says none failed
    for test in INTERPRETED_ONLY:  # run, not skipped, on this core
        assert f"PASSED {test}" in done.stdout, test


def _both_cores(script: str, build: Path, cwd: Path) -> list[tuple[str, str]]:
    """``script``'s standard output under the compiled core (``"1"``) and the interpreted one
    (``"0"``), each in a fresh interpreter that activates the build first."""
    outputs = []
    for switch in ("1", "0"):
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import tokenfair.native\ntokenfair.native.activate()\n{script}",
            ],
            capture_output=True,
            text=True,
            cwd=cwd,
            env={**os.environ, native.SWITCH_ENV: switch, native.DIR_ENV: str(build)},
            check=True,
        )
        outputs.append((switch, done.stdout))
    return outputs


def _alike_on_both_cores(script: str, build: Path, cwd: Path) -> str:
    """What ``script`` prints after the active core's flag (its first word), asserted the same
    on the compiled core and the interpreted one, each being the one that ran."""
    lines = {switch: out.split(" ", 1) for switch, out in _both_cores(script, build, cwd)}
    assert lines["1"][0] == "True"
    assert lines["0"][0] == "False"
    assert lines["1"][1] == lines["0"][1]
    return lines["0"][1]


def test_both_cores_keep_exact_state_for_the_largest_settlements(tmp_path: Path) -> None:
    # Integer token counts stay integers in the compiled core (a `float` parameter would turn
    # 2**40 - 1 into a float and its units would be off by ~5e4).
    build = _build()
    script = (
        "from tokenfair.config import PolicyConfig, TenantConfig, build_config\n"
        "from tokenfair.core import Request, make_scheduler\n"
        "from tokenfair.core.scheduler import MAX_SETTLED_TOKENS\n"
        "from tokenfair import native\n"
        "tenants = [TenantConfig('a', 1.0, 10**6, 1000.0, 'interactive')]\n"
        "s = make_scheduler('tokenfair', build_config(PolicyConfig(), tenants))\n"
        "assert s.submit(Request('r', 'a', 0.0, 100, 10, 'interactive'), 0.0) is None\n"
        "assert s.next_dispatch(0.0) is not None\n"
        "s.complete('r', 1.0, MAX_SETTLED_TOKENS - 1)\n"
        "bucket = s.tenants['a'].bucket\n"
        "from tokenfair.core.bucket import ExactTokenBucket, LeasedBucket\n"
        "from tokenfair.core.units import to_units\n"
        "big = MAX_SETTLED_TOKENS - 1\n"
        "exact = ExactTokenBucket(2 * big, 1.0)\n"
        "exact.level = big\n"
        "leased = LeasedBucket(2 * big, 1.0)\n"
        "leased.grant(big)\n"
        "print(native.status().active, bucket.level_units, s.books(), to_units(big),\n"
        "      exact.level_units, exact.ms_until(big + 1, 0.0), leased.ms_until(big + 2, 0.0))\n"
    )
    level_units = int(_alike_on_both_cores(script, build, tmp_path).split()[0])
    assert level_units % 10**9 == 0  # whole tokens: exact, no float rounding


def test_both_cores_check_the_engine_facts_alike(tmp_path: Path) -> None:
    # EngineFacts' fields reach compiled code typed int and float: a float prompt count was a
    # TypeError naming no field on the compiled core and ran on the interpreted one. Both now
    # refuse the same values with the same message, and replay the same values alike.
    build = _build()
    script = (
        "import math\n"
        "from tokenfair import native\n"
        "from tokenfair.config import PolicyConfig, TenantConfig, build_config\n"
        "from tokenfair.core import Request\n"
        "from tokenfair.sim.simulator import EngineFacts, replay\n"
        "bad = [({'r0': 96.0}, None, None), ({'r0': 96}, 10.5, None), ({'r0': 96}, -5, None),\n"
        "       ({'r0': 96}, 10, math.nan), ({'r0': 96}, None, None, 0.0),\n"
        "       ({'r0': 96}, None, None, -8.0), ({'r0': 96}, None, None, math.nan),\n"
        "       ({'r0': 96}, None, None, None, 'learned', -1.0),\n"
        "       ({'r0': 96}, None, None, None, 'learned', math.inf)]\n"
        "for args in bad:\n"
        "    try:\n"
        "        EngineFacts(*args)\n"
        "        print('accepted', args)\n"
        "    except ValueError as exc:\n"
        "        print(type(exc).__name__, exc)\n"
        "policy = PolicyConfig(max_batch_requests=2, batch_throughput_gain=2.0,\n"
        "    service_tokens_per_ms=10.0, total_kv_blocks=10, kv_block_tokens=16,\n"
        "    max_interactive_wait_ms=1e6, max_batch_wait_ms=1e6)\n"
        "cfg = build_config(policy, [TenantConfig('a', 1.0, 10**9, 1e9, 'interactive')])\n"
        "arrivals = [(Request(f'r{i}', 'a', float(i), 16, 16, 'interactive'), 100, 4)\n"
        "            for i in range(4)]\n"
        "facts = EngineFacts({f'r{i}': 48 for i in range(4)}, 10, 0, 16)\n"
        "print([(d.request_id, d.dispatch_ms, d.ttft_ms, d.kv_occupancy_ratio)\n"
        "       for d, _ in replay(cfg, arrivals, 'tokenfair', facts)])\n"
        "facts = EngineFacts({f'r{i}': 48 for i in range(4)}, 10, 0, 16, 'learned', 3)\n"
        "print([(d.request_id, d.dispatch_ms, d.ttft_ms, d.kv_occupancy_ratio)\n"
        "       for d, _ in replay(cfg, arrivals, 'tokenfair', facts)])\n"
        "print('native', native.status().active)\n"
    )
    lines = {switch: out.splitlines() for switch, out in _both_cores(script, build, tmp_path)}
    assert lines["1"][-1] == "native True"
    assert lines["0"][-1] == "native False"
    assert lines["1"][:-1] == lines["0"][:-1]
    assert all(line.startswith("ValueError EngineFacts.") for line in lines["0"][:9])
    # The overhead reaches the first tokens (3 ms a prompt more than without it).
    assert lines["0"][-3] != lines["0"][-2]


def test_both_cores_read_units_as_tokens_alike_at_any_size(tmp_path: Path) -> None:
    # `tokens_of` is the one conversion of integer units to tokens: CPython's `int / int`
    # rounds once, the compiled one converts to doubles first, so past 2**53 units the two
    # cores read a level, a deficit or a queue's total differently in the last bit (2**53 + 3:
    # ...994 against ...996). The conversion is explicit and both agree.
    build = _build()
    script = (
        "from tokenfair.core.units import tokens_of, tokens_of_float\n"
        "from tokenfair.core.drr import TenantQueue\n"
        "from tokenfair import native\n"
        "sizes = [0, 1, -1, 2**53, 2**53 + 3, -(2**53) - 3, 2**62 + 7, 2**70 + 1,\n"
        "         3 * 10**17 + 11]\n"
        "values = [tokens_of(n).hex() for n in sizes]\n"
        "queue = TenantQueue('a', 1.0)\n"
        "for n in sizes:\n"
        "    queue.deficit_units = n\n"
        "    queue.queued_units = n\n"
        "    values += [queue.deficit.hex(), queue.queued_tokens.hex()]\n"
        "print(native.status().active, ' '.join(values))\n"
    )
    _alike_on_both_cores(script, build, tmp_path)


def test_both_cores_divide_pool_counters_past_2_53_alike(tmp_path: Path) -> None:
    # Pool-wide counters are in units (10**9 a token): past 2**53 (~9 M tokens of a tenant's
    # service) the compiled `int / int` rounded twice (int to double, then divide) where
    # CPython rounds once: the counters, the admission's level and a batch's whole tokens
    # differed in the last bit. Both cores now convert explicitly and agree.
    build = _build()
    script = (
        "from tokenfair.core.units import UNITS_PER_TOKEN as U\n"
        "from tokenfair.core.pool_order import PoolService\n"
        "from tokenfair import native\n"
        "pool = PoolService(lanes=1)\n"
        "lane = pool.lanes[0]\n"
        "quantum = 300 * U + 7\n"
        "values = []\n"
        "for k in range(200):\n"
        "    units = 9_100_000 * U + 12_345_678_901 * k + 1\n"
        "    assert units > 2**53\n"
        "    lane.pool_units['a'] = units\n"
        "    lane.pool_units['b'] = units + 3 * quantum + k\n"
        "    values.append(lane.counter('a', quantum).hex())\n"
        "    ahead = lane.ahead_tokens(('a', quantum, units), False, None,\n"
        "                              [('b', quantum, 2000 * U, 1.0)], 0.0, 10.0, 2000.0, [])\n"
        "    values.append(ahead.hex())\n"
        "lane.served('c', 2**60 + 999_999_999)\n"
        "values.append(repr(pool.take_batch(([],), 0.0)))\n"
        "print(native.status().active, ' '.join(values))\n"
    )
    _alike_on_both_cores(script, build, tmp_path)
