"""Argument checks shared by the subcommands. A refused flag, environment variable or path
is one line on stderr naming it and its value, and exit status 2 (`UsageError`, which
`kvtier.cli.main` prints), raised before the command starts any work."""
from __future__ import annotations

import os

from kvtier.errors import KvtierError


class UsageError(Exception):
    """A flag, environment variable or path the command refuses: one line, exit status 2."""


def int_list(text: str, flag: str, low: int = 1) -> tuple:
    """A comma list of ints, each at least ``low``; an empty list or item is refused."""
    items = [s.strip() for s in text.split(",")]
    try:
        values = tuple(int(s) for s in items)
    except ValueError:
        values = ()
    if not values or min(values) < low:
        raise UsageError(f"{flag}={text!r}: expected a comma list of ints >= {low}")
    return values


def name_list(text: str, flag: str, choices) -> tuple:
    """A comma list of names from ``choices``; an empty list or item is refused."""
    items = tuple(s.strip() for s in text.split(","))
    bad = [s for s in items if s not in choices]
    if bad:
        raise UsageError(f"{flag}={text!r}: {bad[0]!r} is not one of {', '.join(choices)}")
    return items


def as_usage(fn, *args):
    """``fn(*args)``, its `KvtierError` raised as a `UsageError`."""
    try:
        return fn(*args)
    except KvtierError as e:
        raise UsageError(str(e)) from None


def output_dir(text: str, flag: str):
    """The directory ``text`` names, made if missing and tried for writing."""
    from kvtier.writable import writable_dir
    return as_usage(writable_dir, text, flag)


def output_file(text: str, flag: str):
    """The file ``text`` names, tried for writing (an existing file is left as it is)."""
    from kvtier.writable import writable_file
    return as_usage(writable_file, text, flag)


def platform_device(name: str, source: str):
    """The torch device of platform ``name``, refused (naming ``source``: the flag or the
    variable) when the name is unknown or this machine has no such device."""
    from kvtier.autotune.key import platform_device as device_of
    return as_usage(device_of, name, source)


def check_environment() -> None:
    """The environment variables kvtier reads, refused when set to what kvtier would reject
    mid-run (one line naming the variable)."""
    from kvtier.autotune.space import max_programs_from_env
    from kvtier.platforms import ENV_PLATFORM
    from kvtier.platforms.runtime_libs import dma_mode
    from kvtier.pool import dma
    forced = os.environ.get(ENV_PLATFORM)
    if forced:
        platform_device(forced, ENV_PLATFORM)
    try:
        dma_mode()
        max_programs_from_env()
    except ValueError as e:           # KvtierError is a ValueError
        raise UsageError(str(e)) from None
    chunk = os.environ.get(dma.CHUNK_ENV)
    if chunk is not None:        # read here, not through dma.settings(), which keeps its first answer
        try:
            ok = int(chunk) >= 1
        except ValueError:
            ok = False
        if not ok:
            raise UsageError(f"{dma.CHUNK_ENV}={chunk!r}: must be a positive int (bytes)")


def check_fits(flags: str, device, device_bytes: int, host_bytes: int) -> None:
    """Refuse sizes whose buffers alone (a lower bound of what the run allocates) exceed
    this machine's memory, before allocating any: ``flags`` names the sizes."""
    if device.type == "cpu":
        need = {"host memory": (device_bytes + host_bytes, _host_memory())}
    else:
        from kvtier.platforms import device_properties
        need = {f"{device.type} memory": (device_bytes, device_properties(device).get("memory_bytes")),
                "host memory": (host_bytes, _host_memory())}
    for where, (nbytes, have) in need.items():
        if have and nbytes > have:
            raise UsageError(f"{flags}: needs {_gib(nbytes)} of {where}; this machine has {_gib(have)}")


def _host_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"
