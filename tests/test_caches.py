"""Every cache and piece of process state kvtier keeps is registered (`kvtier.caches`),
and docs/design.md's cache table is the registry.

The source is scanned (AST) for what makes a cache: a module-level empty dict, set or
list, or a call of ``dict``/``set``/``list``/``Bounded``/``WeakKeyDictionary``/
``WeakValueDictionary``/``OrderedDict``/``defaultdict``; an ``lru_cache``/``cache``
decorator; an instance attribute made a ``Bounded``, weak dictionary or ``OrderedDict``.
Each must be made through `kvtier.caches` (``bounded``, ``table``, ``lru``) under the
name of where it lives."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtier import caches

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("kvtier", "platforms", "kernels", "autotune", "pool", "adapters", "store", "bench", "cli")
CONTAINERS = {"dict", "set", "list", "Bounded", "WeakKeyDictionary", "WeakValueDictionary", "OrderedDict",
              "defaultdict", "WeakSet"}
MAKERS = {"bounded", "table", "lru"}
BEGIN, END = "<!-- caches: begin (python -m kvtier.caches) -->", "<!-- caches: end -->"


def _call_name(v):
    if isinstance(v, ast.Call):
        f = v.func
        return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
    return None


def _made_by_registry(v) -> bool:
    return (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr in MAKERS
            and isinstance(v.func.value, ast.Name) and v.func.value.id == "caches")


def _makes_cache(v, module_level: bool) -> bool:
    if module_level and isinstance(v, (ast.Dict, ast.Set, ast.List)):
        return not (v.keys if isinstance(v, ast.Dict) else v.elts)
    name = _call_name(v)
    if module_level:        # (a container built with contents is data, not a cache)
        return name in CONTAINERS and (name == "Bounded" or not (v.args or v.keywords))
    return name in ("Bounded", "WeakKeyDictionary", "WeakValueDictionary", "OrderedDict")


def _module_path(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts[1:] if parts[0] == "kvtier" else parts)


def scan(tree: ast.AST, module: str):
    """(line, what, problem) for every cache not made through the registry, or made
    under another name than where it lives."""
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if not isinstance(target, ast.Name) or target.id.startswith("__"):
                continue
            yield from _check(node.lineno, node.value, target.id, module, module_level=True)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                text = ast.unparse(d)
                if _made_by_registry(d):
                    yield from _named(node.lineno, d, node.name, module)
                elif "lru_cache" in text or text in ("cache", "functools.cache"):
                    yield node.lineno, node.name, f"decorated {text}, not caches.lru"
        elif isinstance(node, ast.ClassDef):
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Assign) and isinstance(sub.targets[0], ast.Attribute)
                        and isinstance(sub.targets[0].value, ast.Name) and sub.targets[0].value.id == "self"):
                    attr = sub.targets[0].attr
                    yield from _check(sub.lineno, sub.value, attr, f"{module}.{node.name}", module_level=False)


def _check(line, value, name, where, module_level):
    if _made_by_registry(value):
        yield from _named(line, value, name, where)
    elif _makes_cache(value, module_level):
        yield line, name, f"{ast.unparse(value)[:40]} made outside kvtier.caches"


def _named(line, call, name, where):
    given = call.args[0].value if call.args and isinstance(call.args[0], ast.Constant) else None
    if given != f"{where}.{name}":
        yield line, name, f"registered as {given!r}, lives at {where}.{name!r}"


def _sources():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "scripts" not in path.parts and path != ROOT / "kvtier" / "caches.py":   # (the registry itself)
                yield path


def test_every_cache_is_made_through_the_registry_under_its_own_name():
    bad = [f"{p.relative_to(ROOT)}:{line} {name}: {why}"
           for p in _sources() for line, name, why in scan(ast.parse(p.read_text()), _module_path(p))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, found", [
    ("_SEEN = {}\n", True),
    ("_SEEN = set()\n", True),
    ("from functools import lru_cache\n@lru_cache(maxsize=None)\ndef f(x): return x\n", True),
    ("class A:\n    def __init__(self):\n        self.memo = Bounded(8)\n", True),
    ("_SEEN = caches.table('m._OTHER')\n", True),                     # under another name
    ("_SEEN = caches.table('m._SEEN', key='k', value='v', bound='1')\n", False),
    ("TABLE = {'a': 1}\n", False),                                    # data, not a cache
    ("SHAPE = dict(layers=16)\n", False),
])
def test_the_scan_finds_what_it_names(source, found):
    assert bool(list(scan(ast.parse(source), "m"))) is found


def test_the_design_docs_cache_table_is_the_registry():
    caches.import_all()
    text = (ROOT / "docs" / "design.md").read_text()
    assert BEGIN in text and END in text, "docs/design.md lacks the generated cache table"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert table == caches.markdown(), "docs/design.md's cache table is stale: run python -m kvtier.caches"


def test_every_entry_says_what_it_holds():
    caches.import_all()
    for c in caches.registered().values():
        assert c.kind in caches.KINDS and c.key and c.value and c.bound and c.rule and c.stale, c
        assert "|" not in "".join(c), c          # (it is a markdown table)


def test_a_cache_declared_twice_differently_is_refused(monkeypatch):
    monkeypatch.setattr(caches, "_REGISTRY", caches.registered())       # (leaves the registry as it was)
    caches.declare("tests.test_caches._X", key="k", value="v", bound="1")
    caches.declare("tests.test_caches._X", key="k", value="v", bound="1")      # the same: fine
    with pytest.raises(ValueError, match="declared twice"):
        caches.declare("tests.test_caches._X", key="k", value="w", bound="1")


def test_an_objects_cache_is_declared_before_it_is_made(monkeypatch):
    monkeypatch.setattr(caches, "_REGISTRY", caches.registered())
    with pytest.raises(ValueError, match="before it is declared"):
        caches.bounded("tests.test_caches.A.memo", 8)
    caches.declare("tests.test_caches.A.memo", key="k", value="v", bound="8 per A")
    assert caches.bounded("tests.test_caches.A.memo", 8) is not None


def test_the_registry_is_whole_once_kvtier_is_imported():
    """An object's own caches are declared at import, not when the first object is made:
    the table does not depend on what ran before."""
    caches.import_all()
    names = caches.registered()
    for name in ("pool.device.DevicePool.gathers", "pool.dma.StreamStaging.slots",
                 "kernels.transfer.Transfer.size_classes", "pool.gather.GroupCopies.rows"):
        assert name in names, name
