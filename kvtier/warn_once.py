"""One WARNING per kind of event per process on the ``kvtier`` logger (a fallback to a
slow path, a store failure mode): the first occurrence is logged, later ones are not."""
from __future__ import annotations

import logging
import threading
import warnings

from kvtier import caches

log = logging.getLogger("kvtier")

_warned = caches.table("warn_once._warned", factory=set, kind="state", key="warning key",
                       value="(member) warned once", bound="kinds of warning (a few dozen)",
                       rule="forget() (tests)")
_lock = threading.Lock()


def warn_once(key: str, message: str, *args, python_warning: bool = False) -> None:
    """Log ``message % args`` as a WARNING the first time ``key`` is seen;
    ``python_warning``: also a `RuntimeWarning` (a user-visible fallback)."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message, *args)
    if python_warning:
        warnings.warn(message % args if args else message, RuntimeWarning, stacklevel=3)


def forget(key: str) -> None:
    """Warn about ``key`` again at its next occurrence."""
    with _lock:
        _warned.discard(key)
