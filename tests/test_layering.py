"""The package layering of docs/design.md ("Package map"), checked on the source (AST):

- imports go one way: a package imports only itself and the packages below it, in the
  order ``LAYERS`` (every import, at module level or inside a function);
- no module imports another module's private names (``from m import _x``);
- no module outside ``platforms/`` branches on a platform: no ``torch.cuda`` / ``torch.npu``
  attribute and no comparison with a platform name ("cuda", "npu", "rocm", "hip").
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Bottom to top: each may import those before it. Folder -> package (pyproject.toml).
LAYERS = ("kvtier", "platforms", "kernels", "autotune", "pool", "adapters", "store", "bench", "cli")
PACKAGE = {"kvtier": "kvtier", **{f: f"kvtier.{f}" for f in LAYERS[1:]}}
RANK = {PACKAGE[f]: i for i, f in enumerate(LAYERS)}
PLATFORM_NAMES = {"cuda", "npu", "rocm", "hip"}
ENTRY = {"kvtier/__main__.py"}          # `python -m kvtier` runs the CLI: the top, by definition


def _modules():
    for folder in LAYERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield folder, path


def _package_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and ".".join(parts[:2]) in RANK else "kvtier"


def _imports(tree: ast.AST, module: str):
    """(line, imported module, names) of every import; relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            yield node.lineno, name, tuple(a.name for a in node.names)


def _module_name(folder: str, path: Path) -> str:
    rel = path.relative_to(ROOT / folder).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    name = ".".join([PACKAGE[folder], *parts])
    return name if path.name != "__init__.py" else name + ".__init__"


def test_imports_go_one_way():
    bad = []
    for folder, path in _modules():
        rel = str(path.relative_to(ROOT))
        if rel in ENTRY:
            continue
        own = RANK[PACKAGE[folder]]
        for line, name, _ in _imports(ast.parse(path.read_text()), _module_name(folder, path)):
            if name == "kvtier" or name.startswith("kvtier."):
                if RANK[_package_of(name)] > own:
                    bad.append(f"{rel}:{line} imports {name} (above {PACKAGE[folder]})")
    assert not bad, "\n".join(bad)


def test_no_private_name_of_another_module_is_imported():
    bad = []
    for folder, path in _modules():
        rel = str(path.relative_to(ROOT))
        for line, name, names in _imports(ast.parse(path.read_text()), _module_name(folder, path)):
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    bad.append(f"{rel}:{line} imports {n} from {name}")
    assert not bad, "\n".join(bad)


def _platform_branches(tree: ast.AST):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ("cuda", "npu")
                and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            yield node.lineno, f"torch.{node.attr}"
        elif isinstance(node, ast.Compare):
            for c in [node.left, *node.comparators]:
                consts = c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
                for k in consts:
                    if isinstance(k, ast.Constant) and k.value in PLATFORM_NAMES:
                        yield node.lineno, f"a comparison with {k.value!r}"


def test_no_platform_branch_outside_platforms():
    bad = []
    for folder, path in _modules():
        if folder == "platforms":
            continue
        rel = str(path.relative_to(ROOT))
        for line, what in _platform_branches(ast.parse(path.read_text())):
            bad.append(f"{rel}:{line}: {what}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, found", [
    ("import torch\nif torch.cuda.is_available(): pass\n", True),
    ("if device.type == 'cuda': pass\n", True),
    ("if kind in ('npu', 'cpu'): pass\n", True),
    ("if device.type == 'cpu': pass\n", False),
])
def test_the_platform_scan_finds_what_it_names(source, found):
    assert bool(list(_platform_branches(ast.parse(source)))) is found


def test_the_import_scan_resolves_relative_imports():
    tree = ast.parse("from ..pool import HostPool\nfrom . import faults\nfrom .x import _y\n")
    got = list(_imports(tree, "kvtier.kernels.transfer"))
    assert got == [(1, "kvtier.pool", ("HostPool",)), (2, "kvtier.kernels", ("faults",)),
                   (3, "kvtier.kernels.x", ("_y",))]
    assert RANK[_package_of("kvtier.pool.host")] > RANK[_package_of("kvtier.kernels.transfer")]
