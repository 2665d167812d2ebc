"""Whether a file or directory can be written, asked before the work whose results go there
(a benchmark's output directory, a JSON file, the autotune cache), so that a bad path is
refused at once instead of after a long run.

Writability is tried, not inferred from permission bits: ``os.access`` says yes to root
for a read-only directory and for files under /proc or /sys that refuse every write.
Both functions raise `KvtierError` naming ``arg`` and the path.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvtier.errors import fail


def writable_dir(path, arg: str) -> Path:
    """``path`` as a directory a file can be created in, made (with its parents) if missing."""
    text = os.fspath(path)
    if not text:
        raise fail(arg, text, "empty path")
    d = Path(text)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise fail(arg, text, "exists and is not a directory") from None
    except OSError as e:
        raise fail(arg, text, f"cannot be created ({_reason(e)})") from None
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=".kvtier-probe-")
    except OSError as e:
        raise fail(arg, text, f"cannot be written ({_reason(e)})") from None
    os.close(fd)
    os.unlink(probe)
    return d


def writable_file(path, arg: str) -> Path:
    """``path`` as a file that can be written: an existing file is opened for appending
    (nothing is written to it); a new one is created and removed again."""
    text = os.fspath(path)
    if not text:
        raise fail(arg, text, "empty path")
    p = Path(text)
    try:
        if p.is_dir():
            raise fail(arg, text, "is a directory")
        parent = p.parent
        if not parent.is_dir():
            where = "is not a directory" if parent.exists() else "does not exist"
            raise fail(arg, text, f"directory {str(parent)!r} {where}")
        if p.exists() and not p.is_file():
            return p          # a device or a pipe: opening it here could block or consume it
        if p.exists():
            open(p, "ab").close()
        else:
            open(p, "xb").close()
            p.unlink()
    except OSError as e:
        raise fail(arg, text, f"cannot be written ({_reason(e)})") from None
    return p


def _reason(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__
