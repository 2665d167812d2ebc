"""kvtier.store: a tier beyond host memory. Pages of a host pool written to a shared
store (Redis/Valkey node or cluster, Mooncake Store) or an embedded file store, in one
canonical, layout-independent form, verified on every read (docs/store.md).

Importing it imports no store client: each engine's module imports its own, and only
when a URL of its scheme is opened (`open_store`)."""
from .engine import DEFAULT_TIMEOUT_MS, Engine, Status, open_store

__all__ = ["Engine", "Status", "open_store", "DEFAULT_TIMEOUT_MS"]
