"""The registry of every cache and piece of process state kvtier keeps.

Each one is made through this module with a name, what its key and value are, its bound
and its invalidation rule, and what a stale entry would do: `bounded` (a `Bounded`),
`table` (a dict, set or list filled as the process runs), `lru` (a `functools.lru_cache`
decorator) or `declare` (a memo an object keeps in its own attribute). The registry is
filled as kvtier's modules are imported, `tests/test_caches.py` scans the source for any
cache made otherwise, and `docs/design.md`'s cache table is this registry
(``python -m kvtier.caches`` prints it; the test compares).

``kind``: "cache" holds a pure function of its key (an entry dropped at any time is made
again on the next use); "state" is process state that is not a memo (warn-once sets,
what `install()` changed, threads' failure records), listed so that nothing lives
around the process unnamed.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, NamedTuple

from .bounded import Bounded


class Cache(NamedTuple):
    name: str       # where it lives: module path and attribute
    kind: str       # "cache" or "state"
    key: str
    value: str
    bound: str
    rule: str       # what invalidates an entry
    stale: str      # what a stale entry would do


_REGISTRY: Dict[str, Cache] = {}
KINDS = ("cache", "state")


def declare(name: str, *, key: str, value: str, bound: str, rule: str = "-", stale: str = "-",
            kind: str = "cache") -> str:
    """Register a cache or piece of state called ``name`` (its module path and attribute,
    e.g. ``kernels.launcher._LAUNCHES``); returns the name. Declaring it again with the same
    description is a no-op."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: must be one of {KINDS}")
    entry = Cache(name, kind, key, value, str(bound), rule, stale)
    old = _REGISTRY.setdefault(name, entry)
    if old != entry:
        raise ValueError(f"cache {name!r} is declared twice, differently")
    return name


def bounded(name: str, bound: int, **info) -> Bounded:
    """A new `Bounded` of at most ``bound`` entries, registered as ``name``. An object's
    own cache (one per instance) is declared at its module's level, so that the registry
    is whole once the module is imported, and made here without ``info``."""
    if info:
        declare(name, bound=str(bound), **info)
    elif name not in _REGISTRY:
        raise ValueError(f"cache {name!r} is made before it is declared")
    return Bounded(bound)


def table(name: str, factory: Callable = dict, **info):
    """A new ``factory()`` (dict, set, list, WeakKeyDictionary...) registered as ``name``."""
    declare(name, **info)
    return factory()


def lru(name: str, maxsize=None, *, bound=None, **info):
    """``functools.lru_cache(maxsize)``, registered as ``name`` (``bound``: what bounds an
    unbounded one, e.g. the devices present)."""
    declare(name, bound=bound if bound is not None else str(maxsize), **info)
    return functools.lru_cache(maxsize=maxsize)


def registered() -> Dict[str, Cache]:
    """Every registered cache by name (those of the modules imported so far)."""
    return dict(_REGISTRY)


def import_all() -> None:
    """Import every kvtier module (what the table lists); a module whose engine is not
    installed is left out (it declares no cache: `tests/test_caches.py` checks)."""
    import importlib
    import pkgutil
    import kvtier
    for pkg in ("kvtier", "kvtier.platforms", "kvtier.kernels", "kvtier.autotune", "kvtier.pool",
                "kvtier.adapters", "kvtier.store", "kvtier.bench"):
        mod = importlib.import_module(pkg)
        for info in pkgutil.iter_modules(mod.__path__):
            if pkg == "kvtier" and info.name in ("__main__",):
                continue
            try:
                importlib.import_module(f"{pkg}.{info.name}")
            except ImportError as e:       # an engine's module without its engine (SGLang, Mooncake)
                if (e.name or "").startswith("kvtier"):
                    raise
    del kvtier


def markdown() -> str:
    """The registry as docs/design.md's table, sorted by name."""
    rows = ["| name | kind | key | value | bound | invalidated by | a stale entry would |",
            "|---|---|---|---|---|---|---|"]
    for c in sorted(_REGISTRY.values()):
        rows.append("| " + " | ".join([f"`{c.name}`", c.kind, c.key, c.value, c.bound, c.rule, c.stale]) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    # run as a script this file is __main__; the modules register with kvtier.caches
    from kvtier import caches as _caches
    _caches.import_all()
    print(_caches.markdown())
