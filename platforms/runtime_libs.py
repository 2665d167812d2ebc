"""The accelerator runtime libraries torch already loaded, reached through ctypes for the
few calls torch does not expose (2-D copies, host memory registration). Nothing is
built or loaded anew: a library is found among the ones this process has mapped."""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from typing import Optional


def loaded_library(fragment: str) -> Optional[str]:
    """Path of a shared library this process has mapped whose file name contains
    ``fragment`` (e.g. "libcudart.so", "libascendcl.so"), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if fragment in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


@lru_cache(maxsize=None)
def library(fragment: str) -> Optional[ctypes.CDLL]:
    """The mapped library as a ctypes handle (cached), or None where it is not loaded."""
    path = loaded_library(fragment)
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def function(fragment: str, name: str, argtypes, restype=ctypes.c_int):
    """``name`` from the mapped library, typed; None where the library or symbol is missing."""
    lib = library(fragment)
    f = getattr(lib, name, None) if lib is not None else None
    if f is not None:
        f.argtypes, f.restype = argtypes, restype
    return f
