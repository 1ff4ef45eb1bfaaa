"""Architecture rules that keep the components apart.

- The sidecar package never imports Kopf, the Kubernetes client or the operator package (the
  sidecar owns the config contract; the operator depends on it, never the reverse).
- ``operator/`` is a plain folder: importing ``operator`` still gives the standard library module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_SIDECAR = ("kopf", "kubernetes", "tokenfair_operator")


def test_sidecar_never_imports_operator_side_packages() -> None:
    # Import every sidecar module in a fresh interpreter, then list what got loaded.
    modules = sorted(
        ".".join(path.relative_to(REPO_ROOT / "sidecar").with_suffix("").parts)
        for path in (REPO_ROOT / "sidecar" / "tokenfair").rglob("*.py")
        if path.name != "__main__.py"
    )
    modules = [m.removesuffix(".__init__") for m in modules]
    assert "tokenfair.core.scheduler" in modules
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    loaded = json.loads(
        subprocess.run(
            [sys.executable, "-c", script], check=True, capture_output=True, text=True
        ).stdout
    )
    leaks = [m for m in loaded if m.split(".")[0] in FORBIDDEN_IN_SIDECAR]
    assert leaks == []


def test_operator_folder_does_not_shadow_the_standard_library() -> None:
    assert not (REPO_ROOT / "operator" / "__init__.py").exists()
    result = subprocess.run(
        [sys.executable, "-c", "import operator; print(operator.__file__)"],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    assert str(REPO_ROOT / "operator") not in result.stdout
    assert hasattr(__import__("operator"), "itemgetter")
