"""Architecture rules that keep the components and the packages apart.

- The sidecar's package never imports Kopf, the Kubernetes client or the operator package (the
  sidecar owns the config contract; the operator depends on it, never the reverse), and the
  operator imports of ``tokenfair`` the config contract only (``tokenfair.config``, its wire
  names included), never the sidecar's server, core or simulator.
- Inside ``tokenfair`` each package imports only what is below it (read from every ``import``
  statement, function-level ones included, so a lazy import cannot hide a dependency):
  ``config`` only itself; ``core`` no asyncio, no aiohttp and nothing of ours but ``config``;
  ``records`` (the record format, a contract) nothing of ours but ``config`` and ``core``, no
  asyncio, no aiohttp; ``sim`` not the server, the load generator or the command line;
  ``loadgen`` (a client) and ``server`` not each other nor the command line; only ``cli``
  imports ``commands`` (whose modules may import each other); ``native`` (the compiled core's
  loader, imported first of all) nothing of ours.
- Tests mirror the packages: ``tests/sidecar/<package>/`` for each package of ``tokenfair``,
  ``tests/operator/`` for ``tokenfair_operator``; no test module imports another one (shared
  helpers live in the support modules at ``tests/``).
- ``operator/`` is a plain folder: importing ``operator`` still gives the standard library module.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT, TESTS_DIR

PACKAGE_DIR = REPO_ROOT / "sidecar" / "tokenfair"
OPERATOR_DIR = REPO_ROOT / "operator" / "tokenfair_operator"
OPERATOR_MAY_IMPORT = ("tokenfair.config",)
FORBIDDEN_IN_SIDECAR = ("kopf", "kubernetes", "tokenfair_operator")

# package (first component under tokenfair) -> import prefixes its modules must not use
FORBIDDEN_IMPORTS: dict[str, tuple[str, ...]] = {
    "config": (
        "tokenfair.core",
        "tokenfair.records",
        "tokenfair.sim",
        "tokenfair.loadgen",
        "tokenfair.server",
        "tokenfair.commands",
        "tokenfair.cli",
        "asyncio",
        "aiohttp",
    ),
    "core": (
        "tokenfair.records",
        "tokenfair.sim",
        "tokenfair.loadgen",
        "tokenfair.server",
        "tokenfair.commands",
        "tokenfair.cli",
        "asyncio",
        "aiohttp",
    ),
    "records": (
        "tokenfair.sim",
        "tokenfair.loadgen",
        "tokenfair.server",
        "tokenfair.commands",
        "tokenfair.cli",
        "asyncio",
        "aiohttp",
    ),
    "sim": ("tokenfair.loadgen", "tokenfair.server", "tokenfair.commands", "tokenfair.cli"),
    "loadgen": ("tokenfair.server", "tokenfair.commands", "tokenfair.cli"),
    "server": ("tokenfair.loadgen", "tokenfair.commands", "tokenfair.cli", "tokenfair_operator"),
}
# The compiled core's loader, imported by `tokenfair/__init__.py` before anything else: nothing
# of ours at all (what `config` may not import, and `config`).
FORBIDDEN_IMPORTS["native"] = ("tokenfair.config", *FORBIDDEN_IMPORTS["config"])
# Support modules at tests/ (not tests themselves) and repository-wide tests that stay at the top.
TOP_LEVEL_TESTS = {"test_layout.py", "test_lock.py"}
TEST_FOLDERS = {"sidecar", "operator", "deploy", "harness", "engine"}


def _package_modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        found.append((name, path))
    return found


def _imports(module: str, path: Path, *, names_only: bool = False) -> Iterator[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved). With
    ``names_only``, ``from a import b`` gives ``a.b`` alone, not ``a`` as well (the cycle rule
    tells ``from a import b`` from ``import a``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if not names_only:
                yield base
            # `from tokenfair import commands` imports the submodule tokenfair.commands
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _leaks(imported: str, forbidden: tuple[str, ...]) -> bool:
    return any(imported == prefix or imported.startswith(prefix + ".") for prefix in forbidden)


def test_every_package_imports_only_what_is_below_it() -> None:
    modules = _package_modules()
    assert {name.split(".")[1] for name, _ in modules if name.count(".") >= 1} >= set(
        FORBIDDEN_IMPORTS
    )
    broken = [
        f"{name} imports {imported}"
        for name, path in modules
        if name.count(".") >= 1 and name.split(".")[1] in FORBIDDEN_IMPORTS
        for imported in set(_imports(name, path))
        if _leaks(imported, FORBIDDEN_IMPORTS[name.split(".")[1]])
    ]
    assert broken == []


def _operator_modules() -> list[tuple[str, Path]]:
    return [
        (".".join(path.relative_to(OPERATOR_DIR.parent).with_suffix("").parts), path)
        for path in sorted(OPERATOR_DIR.rglob("*.py"))
    ]


def _operator_leaks(modules: list[tuple[str, Path]]) -> list[str]:
    return [
        f"{name} imports {imported}"
        for name, path in modules
        for imported in sorted(set(_imports(name, path)))
        if imported.startswith("tokenfair.") and not _leaks(imported, OPERATOR_MAY_IMPORT)
    ]


def test_the_operator_imports_only_the_config_contract() -> None:
    modules = _operator_modules()
    assert "tokenfair_operator.serve" in {name for name, _ in modules}
    assert _operator_leaks(modules) == []


def test_the_operator_rule_sees_an_import_of_the_server(tmp_path: Path) -> None:
    # The rule's teeth: what the operator imported before the wire names moved to the contract.
    source = tmp_path / "probe.py"
    source.write_text(
        "from tokenfair.server.config_feed import GENERATION_HEADER\n"
        "from tokenfair.config.wire import GENERATION_FILE\n"
        "from .views import GROUP\n",
        encoding="utf-8",
    )
    assert _operator_leaks([("tokenfair_operator.probe", source)]) == [
        "tokenfair_operator.probe imports tokenfair.server.config_feed",
        "tokenfair_operator.probe imports tokenfair.server.config_feed.GENERATION_HEADER",
    ]


@pytest.mark.parametrize("package", ["config", "records", "server"])
def test_the_packages_have_no_import_cycle(package: str) -> None:
    # A contract is a floor: its modules import one another in one direction only (main had
    # config.document -> config.budget_store -> config.document, hidden in a lazy import).
    # The server too (it had backends -> runtime_settings -> backends, the way back lazy).
    # Importing a module of a subpackage runs the subpackage's __init__ first, so an import
    # of `a.b.c` is an arrow to `a.b` as well, but not from a module inside `a.b` itself.
    prefix = f"tokenfair.{package}"
    modules = {name: path for name, path in _package_modules() if _leaks(name, (prefix,))}
    assert len(modules) > 2
    assert _cycles(_import_edges(modules)) == []


def _names_the_package_itself(imported: str, package: str, modules: Iterable[str]) -> bool:
    """``imported`` is ``package`` itself (``import a.b``, ``from a import b``) or a name its
    ``__init__`` exports (``from a.b import C``), not one of its modules (``from a.b import c``,
    ``import a.b.c``: Python imports the module itself when the package, still initialising,
    does not have it yet)."""
    if imported == package:
        return True
    inside = [module for module in modules if module.startswith(package + ".")]
    return imported.startswith(package + ".") and not any(
        imported == module or imported.startswith(module + ".") for module in inside
    )


def _import_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the modules its imports run. Importing a module of a subpackage runs the
    subpackage's ``__init__`` first, so ``a.b.c`` is an arrow to ``a.b`` as well — but not from
    a module inside ``a.b``, for which only an import of ``a.b`` itself (or of a name its
    ``__init__`` exports) is one: the ``__init__`` runs the package's modules, so that import
    closes a circle whenever ``__init__`` reaches the importer."""
    return {
        name: {
            target
            for imported in _imports(name, path, names_only=True)
            for target in modules
            if target != name
            and _leaks(imported, (target,))
            and (
                not name.startswith(target + ".")
                or _names_the_package_itself(imported, target, modules)
            )
        }
        for name, path in modules.items()
    }


def test_the_cycle_rule_sees_a_circle_through_a_package_init(tmp_path: Path) -> None:
    # config/__init__ imports document, document imports budget_store: budget_store importing
    # `from tokenfair.config import Config` (the package, not the module) closes the circle.
    init, document, store = (tmp_path / f"{n}.py" for n in ("init", "document", "store"))
    init.write_text("from tokenfair.config.document import Config\n", encoding="utf-8")
    document.write_text("from tokenfair.config.store import parse\n", encoding="utf-8")
    store.write_text("def later():\n    from tokenfair.config import Config\n", encoding="utf-8")
    modules = {
        "tokenfair.config": init,
        "tokenfair.config.document": document,
        "tokenfair.config.store": store,
    }
    assert _cycles(_import_edges(modules)) != []
    store.write_text("def later():\n    from tokenfair.config.document import Config\n")
    assert _cycles(_import_edges(modules)) != []
    for spelling in (
        "from tokenfair import config",
        "import tokenfair.config",
        "from .. import config",
    ):
        store.write_text(f"def later():\n    {spelling}\n", encoding="utf-8")
        assert _cycles(_import_edges(modules)) != [], spelling
    wire = tmp_path / "wire.py"
    wire.write_text("X = 1\n", encoding="utf-8")
    modules["tokenfair.config.wire"] = wire
    # A module of the package, whatever the spelling, is no arrow to its __init__.
    store.write_text("from tokenfair.config import wire\nfrom . import wire as again\n")
    assert _cycles(_import_edges(modules)) == []


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every module that reaches itself, with the path back."""
    found = []
    for start in sorted(edges):
        stack = [(start, [start])]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    found.append([*path, start])
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return found


def test_the_cycle_finder_finds_a_lazy_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a"], ["b", "a", "b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_only_the_command_line_imports_the_subcommands() -> None:
    broken = [
        f"{name} imports {imported}"
        for name, path in _package_modules()
        if not name.startswith(("tokenfair.commands", "tokenfair.cli"))
        for imported in set(_imports(name, path))
        if _leaks(imported, ("tokenfair.commands",))
    ]
    assert broken == []


def test_the_import_rules_are_read_from_lazy_imports_too(tmp_path: Path) -> None:
    # The reader must see an import inside a function and a relative one: the rule's teeth.
    source = tmp_path / "probe.py"
    source.write_text(
        "def later():\n    import asyncio\n    from ..server import app\n", encoding="utf-8"
    )
    seen = set(_imports("tokenfair.core.probe", source))
    assert {"asyncio", "tokenfair.server", "tokenfair.server.app"} <= seen
    assert _leaks("tokenfair.server.app", FORBIDDEN_IMPORTS["core"])
    assert not _leaks("tokenfair.serverless", ("tokenfair.server",))


def test_sidecar_never_imports_operator_side_packages() -> None:
    # Import every sidecar module in a fresh interpreter, then list what got loaded.
    modules = [name for name, path in _package_modules() if path.name != "__main__.py"]
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


def test_tests_mirror_the_packages() -> None:
    packages = {path.name for path in PACKAGE_DIR.iterdir() if path.is_dir()} | {
        path.stem for path in PACKAGE_DIR.glob("*.py") if path.stem != "__init__"
    }
    stray = sorted(
        str(path.relative_to(TESTS_DIR))
        for path in TESTS_DIR.glob("test_*.py")
        if path.name not in TOP_LEVEL_TESTS
    )
    assert stray == [], "a test module belongs in the folder of what it tests"
    assert {path.name for path in TESTS_DIR.iterdir() if path.is_dir()} - {
        "data",
        "__pycache__",
    } <= TEST_FOLDERS
    sidecar_folders = {
        path.name for path in (TESTS_DIR / "sidecar").iterdir() if path.name != "__pycache__"
    }
    assert sidecar_folders <= packages, f"no package for {sorted(sidecar_folders - packages)}"


@pytest.mark.parametrize("folder", sorted(TEST_FOLDERS))
def test_no_test_module_imports_another(folder: str) -> None:
    broken = [
        f"{path.relative_to(TESTS_DIR)} imports {imported}"
        for path in sorted((TESTS_DIR / folder).rglob("test_*.py"))
        for imported in set(_imports("tests", path))
        if imported.split(".")[0].startswith("test_")
    ]
    assert broken == []


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
