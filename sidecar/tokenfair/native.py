"""The compiled core: the scheduling core and the replay loop built as C extensions by mypyc,
used only when they were built from exactly the sources beside them.

Why: the core is the per-request path of both the sidecar's admission and ``tokenfair
simulate``; compiled, a replay takes ~35-60 % of the interpreted one's CPU time
(``bench/bench_core.py`` and ``bench/bench_simulate.py`` print both). The sources stay the one
truth: the extensions are built from them unchanged (mypyc compiles the ``mypy --strict``
clean code as it is), they decide exactly as the interpreted modules do
(``tests/sidecar/native/test_native.py`` replays the same traces both ways and compares the
records byte for byte), and nothing depends on them being there.

How:

* ``tokenfair native build [DIR]`` (``make native``; needs mypy's ``mypyc`` and a C
  compiler) compiles :data:`COMPILED` from a copy of the package into a new
  ``DIR/build-<id>/``, then points ``DIR/manifest.json`` at it (:func:`build`): the extension
  file of each module, the interpreter's extension suffix, and the SHA-256 of every source the
  compiled code was built against (:data:`HASHED`: the compiled modules and everything they
  import, since mypyc may inline another module's ``Final`` constants).
* :func:`activate`, called by the entry points before they import the core (the ``tokenfair``
  command in :func:`tokenfair.cli.main`, hence the sidecar it starts; the test suite's
  ``tests/conftest.py``; the benchmarks), reads the manifest of ``$TOKENFAIR_NATIVE_DIR``
  (default ``<sys.prefix>/tokenfair-native``, where ``make native`` puts it in the venv) and,
  if every digest matches the sources of this installation and the suffix this interpreter's,
  puts an import finder for those modules first on ``sys.meta_path``. Otherwise — no build, a
  source edited since (a stale build never runs), another interpreter, ``TOKENFAIR_NATIVE=0``,
  or a compiled module imported already (a process never mixes the two cores) — the
  pure-Python modules are imported, as always. :func:`status` says which, and why
  (``tokenfair native status`` prints it).
* ``import tokenfair`` activates nothing: the operator imports ``tokenfair.config`` and does
  not pay for the check. A library user who wants the compiled core calls
  ``tokenfair.native.activate()`` before importing ``tokenfair.core`` or ``tokenfair.sim``.

The check hashes ~0.2 MB of source once per process (under a millisecond).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Final

COMPILED: Final = (
    "tokenfair.core.baselines",
    "tokenfair.core.batching",
    "tokenfair.core.bucket",
    "tokenfair.core.cost",
    "tokenfair.core.deadlines",
    "tokenfair.core.drr",
    "tokenfair.core.jobs",
    "tokenfair.core.pool_order",
    "tokenfair.core.rounding",
    "tokenfair.core.scheduler",
    "tokenfair.core.shares",
    "tokenfair.core.tokenfair",
    "tokenfair.core.units",
    "tokenfair.records.reading",
    "tokenfair.sim.fairness",
    "tokenfair.sim.fluid",
    "tokenfair.sim.fluid_window",
    "tokenfair.sim.fold",
    "tokenfair.sim.report",
    "tokenfair.sim.simulator",
)
"""The modules built as extensions: the core's per-request path, the replay loop and the report
tallies it feeds (with the report's water-filling, fluid reference and output), and the live
fluid-reference window (a sidecar's per-decision path once wired). Package
``__init__`` modules stay interpreted (they hold no hot code, and the finder needs them)."""

HASHED: Final = (
    "__init__.py",
    "native.py",
    "config",
    "core",
    "records/__init__.py",
    "records/reading.py",
    "sim/__init__.py",
    "sim/fairness.py",
    "sim/fluid.py",
    "sim/fluid_window.py",
    "sim/fold.py",
    "sim/report.py",
    "sim/simulator.py",
)
"""What the compiled code was built against, relative to the ``tokenfair`` package folder
(a folder: every ``.py`` file in it): the compiled modules and all they import, transitively
(``tests/sidecar/native/test_native.py`` reads their import statements and checks it)."""

SWITCH_ENV: Final = "TOKENFAIR_NATIVE"
"""``0``: never use the compiled modules (any other value, or unset: use them if fresh)."""
DIR_ENV: Final = "TOKENFAIR_NATIVE_DIR"
"""Where the build is; default ``<sys.prefix>/tokenfair-native``."""
MANIFEST: Final = "manifest.json"
FORMAT: Final = 3
"""The manifest's format; a build of another format is not used."""

PACKAGE_DIR: Final = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Status:
    """Whether the compiled modules are in use, from where, and if not, why not."""

    active: bool
    directory: Path
    reason: str

    def describe(self) -> str:
        if self.active:
            return f"compiled core in use ({self.directory})"
        return f"interpreted core ({self.reason})"


_status: Status | None = None


def native_dir() -> Path:
    """``$TOKENFAIR_NATIVE_DIR``, or ``<sys.prefix>/tokenfair-native``; absolute (a process
    that changes its directory still finds the modules it has not imported yet)."""
    configured = os.environ.get(DIR_ENV)
    return (Path(configured) if configured else Path(sys.prefix) / "tokenfair-native").absolute()


def source_digests(package_dir: Path = PACKAGE_DIR) -> dict[str, str]:
    """SHA-256 (hex) of each source of :data:`HASHED`, by path relative to ``package_dir``: the
    regular ``.py`` files, not hidden ones (an editor's lock file such as ``.#drr.py`` is a
    dangling link). ``OSError`` if one cannot be read."""
    digests: dict[str, str] = {}
    for entry in HASHED:
        path = package_dir / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            if file.name.startswith(".") or (path.is_dir() and not file.is_file()):
                continue
            relative = file.relative_to(package_dir).as_posix()
            digests[relative] = hashlib.sha256(file.read_bytes()).hexdigest()
    return digests


def _suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


class _CompiledFinder:
    """Finds the modules of one build (and mypyc's shared library) in its directory: a
    ``sys.meta_path`` finder (``find_spec`` is all the protocol asks; not a subclass of
    ``importlib.abc.MetaPathFinder``, whose import costs every command ~7 ms)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.machinery.ModuleSpec(fullname, loader, origin=str(file))


def check_build(directory: Path) -> tuple[dict[str, Path] | None, str]:
    """The module files of the build in ``directory`` if it is fresh (every digest of its
    manifest matches this installation's sources, built for this interpreter), else None and
    why not. The switch (``TOKENFAIR_NATIVE``) is not read here."""
    manifest_path = directory / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"no build at {directory} (make native)"
    except (OSError, ValueError) as exc:
        return None, f"unreadable {manifest_path}: {exc}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, f"{manifest_path}: not a format-{FORMAT} manifest"
    if manifest.get("suffix") != _suffix():
        return None, f"built for another interpreter ({manifest.get('suffix')})"
    try:
        digests = source_digests()
    except OSError as exc:
        return None, f"cannot read the sources to check the build: {exc}"
    if manifest.get("sources") != digests:
        return None, "the sources changed since the build (make native)"
    modules = manifest.get("modules")
    if not isinstance(modules, dict) or set(COMPILED) - set(modules):
        return None, f"{manifest_path}: modules missing"
    files = {name: directory / str(relative) for name, relative in modules.items()}
    missing = [str(file) for file in files.values() if not file.is_file()]
    if missing:
        return None, f"missing {', '.join(missing)}"
    sizes = manifest.get("sizes")
    # A size per file, read at install: a truncated or replaced extension is not imported (a
    # stat each; a digest of ~2 MB of extensions would cost every command milliseconds).
    if not isinstance(sizes, dict) or any(
        files[name].stat().st_size != sizes.get(name) for name in files
    ):
        return None, f"{manifest_path}: an extension file is not the size it was built at"
    return files, ""


def activate() -> Status:
    """Use the build at :func:`native_dir` if it is fresh (see the module's docstring); once per
    process, before any compiled module is imported (if one is imported already, the process
    keeps the interpreted core: it never mixes the two). Returns :func:`status`."""
    global _status
    if _status is not None:
        return _status
    directory = native_dir()
    imported = [name for name in COMPILED if name in sys.modules]
    if os.environ.get(SWITCH_ENV) == "0":
        _status = Status(False, directory, f"{SWITCH_ENV}=0")
        return _status
    if imported:
        reason = f"activated after {imported[0]} was imported (call activate() first)"
        _status = Status(False, directory, reason)
        return _status
    try:
        files, reason = check_build(directory)
    except Exception as exc:  # whatever is wrong with a build, the import of tokenfair works
        files, reason = None, f"cannot check the build: {exc!r}"
    if files is None:
        _status = Status(False, directory, reason)
    else:
        sys.meta_path.insert(0, _CompiledFinder(files))
        _status = Status(True, directory, "")
    return _status


NOT_ACTIVATED: Final = "not activated (tokenfair.native.activate() was not called)"


def status() -> Status:
    """Whether this process uses the compiled modules: :func:`activate`'s answer, or, if it
    was never called, the interpreted core (:data:`NOT_ACTIVATED`)."""
    if _status is None:
        return Status(False, native_dir(), NOT_ACTIVATED)
    return _status


MARKER: Final = ".tokenfair-native"
"""The file that marks a directory as one :func:`build` may write into (and prune)."""


def is_build_id(name: str) -> bool:
    """``build-<ns since the epoch>-<pid>``: the name of a build's folder, the only entries a
    build removes besides its own leftovers (``.staging-<id>``, ``.manifest.json.<id>``)."""
    parts = name.split("-")
    return len(parts) == 3 and parts[0] == "build" and parts[1].isdigit() and parts[2].isdigit()


LOCK: Final = ".lock"


def _ours(directory: Path) -> bool:
    """``directory`` holds :data:`MARKER`, or a manifest of ours (a build of an earlier
    format, made before the marker existed)."""
    if (directory / MARKER).is_file():
        return True
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and {"format", "suffix", "sources"} <= set(manifest)


def _claim(directory: Path, *, mark: bool) -> None:
    """Refuse a ``directory`` that :func:`build` may not write into: one that exists and holds
    anything but a lock file of ours, unless it is ours (:func:`_ours`). With ``mark`` (under
    the lock), write the marker."""
    if directory.exists() and not (
        directory.is_dir() and ({p.name for p in directory.iterdir()} <= {LOCK} or _ours(directory))
    ):
        raise RuntimeError(
            f"{directory} exists and is not a build directory (no {MARKER}): "
            "give a new or empty directory"
        )
    if mark:
        _create(directory / MARKER)


def _locked(directory: Path) -> Path:
    """The lock file of ``directory``, creating the directory (0755, whatever the umask, when
    this call makes it) and the file (0644)."""
    try:
        directory.mkdir(parents=True)
    except FileExistsError:
        pass  # there already, or made by a concurrent build: the lock decides
    else:
        directory.chmod(0o755)  # readable by whoever runs the venv, as the venv is
    lock = directory / LOCK
    _create(lock)
    return lock


def _create(path: Path) -> None:
    """An empty file at ``path`` if there is none, readable by all (0644, whatever the umask)."""
    if not path.exists():
        path.touch()
        path.chmod(0o644)


def build(directory: Path) -> dict[str, object]:
    """Compile :data:`COMPILED` from a copy of this package and install it as the current build
    of ``directory``; returns the manifest. Needs mypyc (the ``dev`` extra's mypy) and a C
    compiler; every failure raises ``RuntimeError``, leaving the current build as it was.

    Layout: ``directory/manifest.json`` names the current build, ``directory/build-<id>/``
    holds its files; a build is never changed once installed. The new build is staged inside
    ``directory``, renamed to its own ``build-<id>``, then the manifest is replaced in one
    ``os.replace``: a process reading it sees the old build or the new one, whole. The build the
    replaced manifest named is kept (a process that read it may still import from it); every
    other ``build-<id>`` folder is removed. Builds into one directory are serialised by a lock
    (``directory/.lock``). ``directory`` must be new, empty, or one this function made (it
    holds :data:`MARKER`), checked before compiling and again under the lock: a build never
    removes anything but build folders and its own leftovers. Files are written readable by
    all (0644, folders 0755), whatever the umask, as a venv's are."""
    import fcntl  # only a build needs these: every command imports this module at start
    import shutil
    import subprocess
    import tempfile

    directory = directory.absolute()
    _claim(directory, mark=False)  # fail before a 20 s compile, not after
    try:
        digests = source_digests()
    except OSError as exc:
        raise RuntimeError(f"cannot read the sources: {exc}") from None
    suffix = _suffix()
    with tempfile.TemporaryDirectory(prefix="tokenfair-native-") as scratch:
        work = Path(scratch)
        shutil.copytree(
            PACKAGE_DIR,
            work / "tokenfair",
            ignore=shutil.ignore_patterns("__pycache__", "*.so", ".*"),
        )
        # mypy's options are ours, not whatever config a user has: strict, as `make lint`.
        config = work / "mypy.ini"
        config.write_text("[mypy]\nstrict = True\n", encoding="utf-8")
        sources = [name.replace(".", "/") + ".py" for name in COMPILED]
        done = subprocess.run(
            [sys.executable, "-m", "mypyc", "--config-file", str(config), *sources],
            cwd=work,
            env={**os.environ, "MYPYC_OPT_LEVEL": "3"},
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"mypyc failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        if source_digests(work / "tokenfair") != digests:
            raise RuntimeError("the sources changed during the build: build again")
        try:
            _claim(directory, mark=False)  # before creating anything in it
            with _locked(directory).open("a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                _claim(directory, mark=True)  # again under the lock: it may have changed
                return _install(directory, work, suffix, digests)
        except OSError as exc:
            raise RuntimeError(f"cannot install the build in {directory}: {exc}") from None


def _named_build(directory: Path) -> str | None:
    """The build ``directory/manifest.json`` names, None if none can be read."""
    try:
        build_id = json.loads((directory / MANIFEST).read_text(encoding="utf-8")).get("build")
    except (OSError, ValueError, AttributeError):
        return None
    return build_id if isinstance(build_id, str) else None


def _install(
    directory: Path, work: Path, suffix: str, digests: dict[str, str]
) -> dict[str, object]:
    """The install step of :func:`build`, under its lock: sweep, stage, rename, switch, prune."""
    import shutil
    import time

    for leftover in directory.glob(".staging-build-*"):  # a build that died (we hold the lock)
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in directory.glob(f".{MANIFEST}.build-*"):
        leftover.unlink(missing_ok=True)
    previous = _named_build(directory)
    build_id = f"build-{time.time_ns()}-{os.getpid()}"
    while (directory / build_id).exists():  # a clock stepped back: never reuse a folder
        build_id = f"build-{time.time_ns() + 1}-{os.getpid()}"
    staged = directory / f".staging-{build_id}"
    pending = directory / f".{MANIFEST}.{build_id}"
    manifest: dict[str, object] = {}
    try:
        modules: dict[str, str] = {}
        names = [(name, name.replace(".", "/") + suffix) for name in COMPILED]
        # mypyc's shared library (named by a hash of the module list): a top-level module
        # that every compiled module imports.
        names += [(shared.name[: -len(suffix)], shared.name) for shared in work.glob(f"*{suffix}")]
        sizes: dict[str, int] = {}
        for name, relative in names:
            target = staged / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(work / relative, target)
            target.chmod(0o644)
            modules[name] = f"{build_id}/{relative}"
            sizes[name] = target.stat().st_size
        for folder in [staged, *(p for p in staged.rglob("*") if p.is_dir())]:
            folder.chmod(0o755)
        staged.rename(directory / build_id)
        manifest = {
            "format": FORMAT,
            "suffix": suffix,
            "build": build_id,
            "modules": modules,
            "sizes": sizes,
            "sources": digests,
        }
        pending.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        pending.chmod(0o644)
        os.replace(pending, directory / MANIFEST)
    finally:
        # Whatever stopped it (an error, an interrupt), the manifest on disk decides: if it does
        # not name this build, nothing of this build is left; if it does, the build stays.
        if _named_build(directory) != build_id:
            shutil.rmtree(staged, ignore_errors=True)
            shutil.rmtree(directory / build_id, ignore_errors=True)
            pending.unlink(missing_ok=True)
    try:
        for entry in directory.iterdir():
            if (
                entry.is_dir()
                and is_build_id(entry.name)
                and entry.name not in (build_id, previous)
            ):
                shutil.rmtree(entry, ignore_errors=True)
    except OSError:
        pass  # the new build is in use already; an old one stays until the next build
    return manifest
