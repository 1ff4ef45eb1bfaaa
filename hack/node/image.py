#!/usr/bin/env python3
"""Build tokenfair's image from the Dockerfile, and the node's pause image, with no registry.

``make image`` runs ``image.py build``; the node fixture (tests/kubenode.py) runs ``image.py
paths`` to learn which files to import. Standard library only. Every output is a ``docker save``
tarball under ``$TOKENFAIR_CACHE/images/``, named by a content key, so a second run with the same
inputs is a no-op (~0.1 s) and a changed source file names a new tarball:

- ``python-base-<suite>-<key>.tar``: a ``debootstrap --variant=minbase`` root of Debian <suite>
  with ``python3``, ``python3-venv``, ``python-is-python3`` and ``ca-certificates``; key =
  sha256(suite, package list, BASE_RECIPE, BASE_PRUNE): pinned by these build inputs, as it has
  no registry digest. It stands in for the Dockerfile's default ``python:3.11-slim-bookworm``
  (same Debian, Debian's own Python 3.11; documentation and translations pruned as slim does).
  Debian's mirror is debootstrap's own default unless ``$DEBIAN_MIRROR`` names another.
- ``wheels-<key>/``: the wheels of the image's lock file (:data:`IMAGE_LOCK`: every dependency
  of ``tokenfair[operator]`` and the build backend, pinned with hashes), fetched by ``pip
  download --require-hashes`` on this machine (whatever index and certificates pip is
  configured with here) for the base's exact CPython (recorded in ``python-base-*.python``: a
  marker like ``python_full_version < "3.11.3"`` must be evaluated for Debian's 3.11.2, not
  for the Python running this script) and glibc (:data:`SUITE_MANYLINUX`); key =
  sha256(the lock file, that version, the platform).
- ``tokenfair-<key>.tar``: ``docker build`` of the repository's Dockerfile with
  ``--build-arg PYTHON_IMAGE=<the imported base>`` and ``PIP_INSTALL_ARGS=--no-index
  --find-links=/src`` on a context holding exactly what the Dockerfile copies plus ``wheels/``:
  nothing in the build talks to a package index, and the Dockerfile installs the lock file
  ``--require-hashes`` (then tokenfair itself ``--no-deps``); key = sha256(base key, wheelhouse
  key, Dockerfile, pyproject.toml, README.md, the lock file, every file under the two import
  packages). Tagged
  ``tokenfair/tokenfair:<appVersion of charts/tokenfair/Chart.yaml>``, the chart's default.
- ``pause-<key>.tar``: ``FROM scratch`` + ``hack/node/pause`` (a static Go program); key =
  sha256(its sources, ``go version``). Tagged ``tokenfair/pause:<key[:12]>``.

Docker: a private ``dockerd`` (Debian's docker.io) is started for the build in a temporary folder
with its own socket, data root and managed containerd, no bridge, no iptables rules and no
``ip_forward`` change, builds with the classic builder (``DOCKER_BUILDKIT=0``: BuildKit would
fetch the ``# syntax`` frontend from a registry), and is stopped and removed afterwards, with
the host folders it creates regardless of its flags (:data:`DOCKERD_HOST_DIRS`). Nothing else
outside the cache is written. Needs root, ``debootstrap``, ``dockerd``, ``go`` and pip.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PAUSE_SRC = REPO_ROOT / "hack" / "node" / "pause"
CHART_FILE = REPO_ROOT / "charts" / "tokenfair" / "Chart.yaml"
SUITE = "bookworm"
# glibc of the suite: the newest manylinux tag its wheels may carry (pip accepts older ones too).
SUITE_MANYLINUX = "manylinux_2_36"
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
# Bump when the base's recipe below changes in a way the key cannot see.
BASE_RECIPE = "minbase-2"
# Dropped from the base as Docker's slim images drop them (dpkg path-exclude): documentation,
# translations, apt's package lists and caches. Globs relative to the root.
BASE_PRUNE = (
    "usr/share/doc/*",
    "usr/share/man/*",
    "usr/share/info/*",
    "usr/share/locale/*",
    "var/cache/apt/*.bin",
    "var/cache/apt/archives/*.deb",
    "var/lib/apt/lists/*",
    "var/cache/debconf/*-old",
    "var/log/*",
)
IMAGE_REPOSITORY = "tokenfair/tokenfair"
PAUSE_REPOSITORY = "tokenfair/pause"
# The image's lock file (`make lock`): what the wheelhouse fetches and the Dockerfile installs.
IMAGE_LOCK = "requirements/image.txt"
# Inputs of the project image besides the two import packages (the Dockerfile's COPY lines).
IMAGE_FILES = ("Dockerfile", "pyproject.toml", "README.md", IMAGE_LOCK)
IMAGE_TREES = ("sidecar/tokenfair", "operator/tokenfair_operator")
DOCKERD_START_TIMEOUT_S = 60.0
# Host folders dockerd (and the containerd it starts) makes whatever its flags say: removed
# after the build when they did not exist before it, with the one file dockerd writes there.
DOCKERD_HOST_DIRS = ("/etc/docker", "/run/docker", "/opt/containerd", "/run/containerd")
DOCKERD_HOST_FILES = ("/etc/docker/key.json",)
DOCKERD_STOP_TIMEOUT_S = 20.0


def log(message: str) -> None:
    print(f"image: {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$TOKENFAIR_CACHE``, else ``$XDG_CACHE_HOME/tokenfair``, else ``~/.cache/tokenfair``."""
    if explicit := os.environ.get("TOKENFAIR_CACHE"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "tokenfair"


def app_version() -> str:
    """``appVersion`` of the chart: the tag the chart's default ``image.tag: ""`` resolves to."""
    match = re.search(r'^appVersion:\s*"?([^"\s]+)"?\s*$', CHART_FILE.read_text(), re.MULTILINE)
    if match is None:
        raise SystemExit(f"image: no appVersion in {CHART_FILE}")
    return match.group(1)


def _digest(parts: list[tuple[str, bytes]]) -> str:
    """sha256 over (name, length, bytes) of each part: renames and moves change the key too."""
    h = hashlib.sha256()
    for name, data in parts:
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _tree_files(root: Path) -> list[Path]:
    """Files under ``root`` as the Docker build context sees them (no bytecode caches)."""
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def base_key() -> str:
    recipe = f"{SUITE}\0{','.join(BASE_PACKAGES)}\0{BASE_RECIPE}\0{BASE_PRUNE}".encode()
    return _digest([("recipe", recipe)])[:16]


def base_python(cache: Path) -> str:
    """The exact Python version of the base (e.g. ``3.11.2``), recorded when it was built;
    ``unknown`` before that. Markers such as ``python_full_version < "3.11.3"`` need it."""
    record = cache / "images" / f"python-base-{SUITE}-{base_key()}.python"
    return record.read_text().strip() if record.exists() else "unknown"


def wheels_key(cache: Path, root: Path = REPO_ROOT) -> str:
    parts = [(IMAGE_LOCK, (root / IMAGE_LOCK).read_bytes())]
    parts.append(("python", base_python(cache).encode()))
    parts.append(("platform", f"{SUITE_MANYLINUX}_{platform.machine()}".encode()))
    return _digest(parts)[:16]


def image_key(cache: Path, root: Path = REPO_ROOT) -> str:
    """The key of the image built from the sources under ``root`` (the repository, or the
    snapshot ``build`` takes of it: sources edited during a build never mislabel a tarball)."""
    parts = [("base", base_key().encode()), ("wheels", wheels_key(cache, root).encode())]
    for name in IMAGE_FILES:
        parts.append((name, (root / name).read_bytes()))
    for tree in IMAGE_TREES:
        for path in _tree_files(root / tree):
            parts.append((str(path.relative_to(root)), path.read_bytes()))
    return _digest(parts)[:16]


def pause_key() -> str:
    go = shutil.which("go")
    go_version = (
        subprocess.run([go, "version"], capture_output=True, text=True).stdout if go else ""
    )
    parts = [("go", go_version.encode())]
    parts += [(p.name, p.read_bytes()) for p in _tree_files(PAUSE_SRC)]
    return _digest(parts)[:16]


def paths(cache: Path, root: Path = REPO_ROOT) -> dict[str, str]:
    """Where each tarball of the sources under ``root`` is (or would be) and its reference."""
    images = cache / "images"
    base, image, pause = base_key(), image_key(cache, root), pause_key()
    return {
        "base_tar": str(images / f"python-base-{SUITE}-{base}.tar"),
        "base_ref": f"tokenfair/python-base:{SUITE}-{base}",
        "wheels": str(images / f"wheels-{wheels_key(cache, root)}"),
        "image_tar": str(images / f"tokenfair-{image}.tar"),
        "image_ref": f"{IMAGE_REPOSITORY}:{app_version()}",
        "pause_tar": str(images / f"pause-{pause}.tar"),
        "pause_ref": f"{PAUSE_REPOSITORY}:{pause[:12]}",
    }


def run(cmd: list[str], **kwargs: object) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload]


# --- the base: debootstrap ---------------------------------------------------------------------


def build_base(tar: Path) -> None:
    """debootstrap a minimal Debian with Python into a folder beside ``tar``, then tar it."""
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise SystemExit("image: needs `debootstrap` (apt-get install debootstrap) for the base")
    work = Path(tempfile.mkdtemp(prefix="base-", dir=tar.parent))
    try:
        root = work / "root"
        cmd = [debootstrap, "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}"]
        cmd += [SUITE, str(root)]
        # Debian's mirror: debootstrap's own default unless DEBIAN_MIRROR names another.
        if mirror := os.environ.get("DEBIAN_MIRROR"):
            cmd.append(mirror)
        run(cmd, stdout=subprocess.DEVNULL)
        version = subprocess.run(
            [
                "chroot",
                str(root),
                "python3",
                "-c",
                "import platform; print(platform.python_version())",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for pattern in BASE_PRUNE:
            for child in root.glob(pattern):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                elif child.is_file() or child.is_symlink():
                    child.unlink()
        partial = tar.with_suffix(".partial")
        run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."])
        tar.with_suffix(".python").write_text(version + "\n")
        partial.rename(tar)
    finally:
        _unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)


# --- the wheelhouse: pip on this machine ---------------------------------------------------------


def manylinux_tags() -> list[str]:
    """Every manylinux platform tag the suite's glibc accepts, newest first: pip does not
    expand a PEP 600 ``--platform`` to the older glibc versions it implies."""
    arch = platform.machine()
    newest = int(SUITE_MANYLINUX.rsplit("_", 1)[1])
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(newest, 4, -1)]
    return [*tags, f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]


def build_wheels(folder: Path, root: Path, python: str) -> None:
    """``pip download --require-hashes`` the image's lock file (every dependency of
    ``tokenfair[operator]`` and the build backend), as wheels for the base's CPython ``python``
    (X.Y.Z: markers are evaluated for it, not for the Python running this script) on
    :data:`SUITE_MANYLINUX`, into ``folder``. A file whose hash is not in the lock, or a
    dependency the lock lacks for this Python, fails here rather than in ``docker build``."""
    major, minor = python.split(".")[:2]
    target = ["--only-binary=:all:", "--implementation=cp", f"--python-version={python}"]
    target.append(f"--abi=cp{major}{minor}")
    target += [f"--platform={tag}" for tag in manylinux_tags()]
    partial = folder.with_suffix(".partial")
    shutil.rmtree(partial, ignore_errors=True)
    pip = [sys.executable, "-c", PIP_FOR_PYTHON, python, "--disable-pip-version-check"]
    lock = ["--require-hashes", "--requirement", str(root / IMAGE_LOCK)]
    run([*pip, "download", "--quiet", *target, "--dest", str(partial), *lock])
    partial.rename(folder)


# pip evaluates environment markers for the interpreter running it even with --python-version
# (e.g. redis needs async-timeout only where python_full_version < "3.11.3"): run it with the
# marker environment of the target Python. argv: VERSION then pip's own arguments.
PIP_FOR_PYTHON = """
import runpy, sys
from pip._vendor.packaging import markers
version = sys.argv.pop(1)
default = markers.default_environment
def target():
    env = default()
    env.update(python_full_version=version, implementation_version=version,
               python_version=".".join(version.split(".")[:2]))
    return env
markers.default_environment = target
sys.argv[0] = "pip"
runpy.run_module("pip", run_name="__main__", alter_sys=True)
"""


def snapshot_sources(folder: Path) -> None:
    """Copy what the Dockerfile's COPY lines read (as .dockerignore allows) to ``folder``."""
    for name in IMAGE_FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, folder / name)
    for tree in IMAGE_TREES:
        for path in _tree_files(REPO_ROOT / tree):
            target = folder / path.relative_to(REPO_ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


# --- a private dockerd ---------------------------------------------------------------------------


def _unmount_under(folder: Path) -> None:
    """Unmount whatever is still mounted below ``folder`` (deepest first): a killed debootstrap
    or dockerd may leave proc, sysfs or overlay mounts behind."""
    prefix = str(folder.resolve()) + "/"
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for target in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], check=False, capture_output=True)


@contextlib.contextmanager
def private_dockerd() -> Iterator[list[str]]:
    """A dockerd of our own; yields the ``docker`` command prefix that talks to it."""
    dockerd, docker = shutil.which("dockerd"), shutil.which("docker")
    if dockerd is None or docker is None:
        raise SystemExit("image: needs `dockerd` and `docker` (apt-get install docker.io)")
    work = Path(tempfile.mkdtemp(prefix="tokenfair-dockerd-"))
    sock = work / "docker.sock"
    cmd = [
        dockerd,
        f"--data-root={work / 'data'}",
        f"--exec-root={work / 'exec'}",
        f"--pidfile={work / 'dockerd.pid'}",
        f"--host=unix://{sock}",
        "--bridge=none",
        "--iptables=false",
        "--ip6tables=false",
        "--ip-masq=false",
        "--ip-forward=false",  # leave the host's net.ipv4.ip_forward alone
        "--storage-driver=overlay2",
        "--log-level=warn",
    ]
    client = [docker, f"--host=unix://{sock}"]
    existed = {folder: Path(folder).exists() for folder in DOCKERD_HOST_DIRS}
    with (work / "dockerd.log").open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + DOCKERD_START_TIMEOUT_S
        while subprocess.run([*client, "version"], capture_output=True).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (work / "dockerd.log").read_text(errors="replace")[-3000:]
                raise SystemExit(f"image: dockerd did not start\n{tail}")
            time.sleep(0.2)
        yield client
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=DOCKERD_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)
        remove_created_dirs(existed, DOCKERD_HOST_FILES)


def remove_created_dirs(existed: dict[str, bool], files: tuple[str, ...] = ()) -> None:
    """Remove the folders of ``existed`` that did not exist before (their known ``files`` and
    then every empty folder, deepest first; anything else found there is left alone)."""
    for folder, was_there in existed.items():
        if was_there or not Path(folder).is_dir():
            continue
        for name in files:
            if name.startswith(folder + "/"):
                Path(name).unlink(missing_ok=True)
        for dirpath, _, _ in os.walk(folder, topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def docker_build(
    client: list[str], context: Path, tag: str, build_args: dict[str, str], dockerfile: Path
) -> None:
    """The classic builder, ``--network=none``: the build cannot reach any index or registry."""
    cmd = [*client, "build", "--network=none", "--force-rm", "-t", tag, "-f", str(dockerfile)]
    for key, value in build_args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    run([*cmd, str(context)], env={**os.environ, "DOCKER_BUILDKIT": "0"})


def docker_save(client: list[str], ref: str, tar: Path) -> None:
    partial = tar.with_suffix(".partial")
    run([*client, "save", "-o", str(partial), ref])
    partial.rename(tar)


# --- the commands --------------------------------------------------------------------------------


def build(cache: Path) -> dict[str, str]:
    """Make whatever of base, wheelhouse, image and pause is missing for a snapshot of the
    sources taken now; return :func:`paths` of that snapshot."""
    with tempfile.TemporaryDirectory(prefix="tokenfair-context-") as tmp:
        context = Path(tmp)
        snapshot_sources(context)
        where = paths(cache, context)
        (cache / "images").mkdir(parents=True, exist_ok=True)
        base_tar, image_tar, pause_tar = (
            Path(where[k]) for k in ("base_tar", "image_tar", "pause_tar")
        )
        if not base_tar.exists() or not base_tar.with_suffix(".python").exists():
            started = time.monotonic()
            build_base(base_tar)
            log(f"base {base_tar.name} in {time.monotonic() - started:.0f} s")
            where = paths(cache, context)  # the wheelhouse and image keys name its Python
            image_tar = Path(where["image_tar"])
        wheels = Path(where["wheels"])
        if not image_tar.exists() and not wheels.exists():
            started = time.monotonic()
            build_wheels(wheels, context, base_python(cache))
            log(f"wheelhouse {wheels.name} in {time.monotonic() - started:.0f} s")
        if not image_tar.exists() or not pause_tar.exists():
            with private_dockerd() as client:
                if not image_tar.exists():
                    started = time.monotonic()
                    importing = [*client, "import", str(base_tar), where["base_ref"]]
                    run(importing, stdout=subprocess.DEVNULL)
                    shutil.copytree(wheels, context / "wheels")
                    args = {
                        "PYTHON_IMAGE": where["base_ref"],
                        "PIP_INSTALL_ARGS": "--no-index --find-links=/src",
                    }
                    docker_build(client, context, where["image_ref"], args, context / "Dockerfile")
                    docker_save(client, where["image_ref"], image_tar)
                    log(f"{where['image_ref']} in {time.monotonic() - started:.0f} s")
                    report_image(client, where["image_ref"])
                if not pause_tar.exists():
                    build_pause(client, where["pause_ref"], pause_tar)
    prune(cache / "images", where)
    for key in ("image_tar", "pause_tar"):
        log(f"{where[key]} ({Path(where[key]).stat().st_size / 1e6:.0f} MB)")
    return where


# Tarballs of earlier sources kept beside the current ones (another checkout may be using them).
KEEP_OLDER = 1


def prune(images: Path, where: dict[str, str]) -> None:
    """Remove all but the newest :data:`KEEP_OLDER` earlier outputs of each kind."""
    current = {Path(where[k]).name for k in ("base_tar", "wheels", "image_tar", "pause_tar")}
    current.add(Path(where["base_tar"]).with_suffix(".python").name)
    patterns = ("python-base-*.tar", "python-base-*.python", "wheels-*", "tokenfair-*.tar")
    for pattern in (*patterns, "pause-*.tar"):
        older = sorted(
            (p for p in images.glob(pattern) if p.name not in current and ".partial" not in p.name),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        for stale in older[KEEP_OLDER:]:
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def report_image(client: list[str], ref: str) -> None:
    """Print the image's size and how long ``tokenfair --help`` takes to start in it (3 runs)."""
    size = subprocess.run(
        [*client, "image", "inspect", "--format", "{{.Size}}", ref],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    times = []
    for _ in range(3):
        started = time.monotonic()
        subprocess.run(
            [*client, "run", "--rm", "--network=none", ref, "tokenfair", "--help"],
            check=True,
            capture_output=True,
        )
        times.append(time.monotonic() - started)
    log(
        f"{ref}: {int(size) / 1e6:.0f} MB; `docker run --rm IMAGE tokenfair --help` "
        + ", ".join(f"{t:.2f}" for t in times)
        + " s"
    )


def build_pause(client: list[str], ref: str, tar: Path) -> None:
    go = shutil.which("go")
    if go is None:
        raise SystemExit("image: needs Go on PATH for the pause program")
    with tempfile.TemporaryDirectory(prefix="tokenfair-pause-") as tmp:
        context = Path(tmp)
        env = {**os.environ, "GOWORK": "off", "GOFLAGS": "-mod=readonly", "CGO_ENABLED": "0"}
        run(
            [go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(context / "pause"), "."],
            cwd=PAUSE_SRC,
            env=env,
        )
        dockerfile = context / "Dockerfile"
        dockerfile.write_text(
            'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n'
        )
        docker_build(client, context, ref, {}, dockerfile)
    docker_save(client, ref, tar)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("command", choices=("paths", "build"))
    parser.add_argument("--cache", type=Path, default=None, help="default: $TOKENFAIR_CACHE")
    args = parser.parse_args(argv)
    cache = args.cache or cache_root()
    where = paths(cache) if args.command == "paths" else build(cache)
    print(json.dumps(where, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
