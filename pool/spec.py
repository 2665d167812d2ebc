"""What a pool stores, as data: one `Component` per per-layer buffer kind.

MHA pools hold K and V, MLA pools one latent row (or latent and rope split), and a
DSA/NSA indexer adds index_k rows and their fp32 scales with its own layer count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import torch

from kvtier.errors import fail
from kvtier.kernels.validate import is_int


@dataclass(frozen=True)
class Component:
    """One buffer kind: ``num_layers`` layers of rows shaped ``row_shape`` of ``dtype``."""

    name: str
    num_layers: int
    row_shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * torch.empty(0, dtype=self.dtype).element_size()

    def mismatch(self, other: "Component"):
        """None when ``other`` holds the same rows, else (field, other's value, ours) for
        the first differing field, named as engines name it (dtype, head_num, head_dim)."""
        a, b = other.row_shape, self.row_shape
        for field, theirs, ours in (("dtype", other.dtype, self.dtype),
                                    ("head_num", a[:-1], b[:-1]),
                                    ("head_dim", a[-1], b[-1])):
            if theirs != ours:
                return field, theirs, ours
        return None


@dataclass(frozen=True)
class IndexerSpec:
    """A DSA/NSA indexer: per token ``index_head_dim`` bytes of index_k (fp8 stored as
    uint8) and ``scale_dim`` fp32 scales, for ``num_layers`` layers (the stage's first
    ``num_layers`` layers; it may be fewer than the model's)."""

    num_layers: int
    index_head_dim: int = 128
    scale_dim: int = 1
    dtype: torch.dtype = torch.uint8

    def __post_init__(self):
        check_positive(**{"indexer.num_layers": self.num_layers,
                          "indexer.index_head_dim": self.index_head_dim,
                          "indexer.scale_dim": self.scale_dim})
        check_dtype("indexer.dtype", self.dtype)

    def components(self):
        return [Component("index_k", self.num_layers, (self.index_head_dim,), self.dtype),
                Component("index_scale", self.num_layers, (self.scale_dim,), torch.float32)]


def check_positive(**values) -> None:
    """Each value is an int > 0 (a bool is no count)."""
    for name, v in values.items():
        if not is_int(v) or v <= 0:
            raise fail(name, v, "must be a positive int")


def check_non_negative(**values) -> None:
    """Each value is an int >= 0 (a bool is no index)."""
    for name, v in values.items():
        if not is_int(v) or v < 0:
            raise fail(name, v, "must be a non-negative int")


def check_bool(arg: str, v, optional: bool = False) -> None:
    """``v`` is True or False (or None where ``optional``): a string such as 'yes' is refused."""
    if not (isinstance(v, bool) or (optional and v is None)):
        raise fail(arg, v, "must be True or False" + (" or None" if optional else ""))


def check_dtype(arg: str, dtype) -> None:
    """``dtype`` is a torch.dtype (a string such as "bfloat16" is refused, not guessed)."""
    if not isinstance(dtype, torch.dtype):
        raise fail(arg, dtype, "must be a torch.dtype, e.g. torch.bfloat16")


def check_device(arg: str, device, factory=None) -> torch.device:
    """``device`` as a torch.device; an unknown name, or (without a ``factory`` supplying
    the memory) a device torch cannot allocate on, is refused before anything is allocated."""
    if not isinstance(device, (str, torch.device)) and not is_int(device):
        raise fail(arg, device, "must be a torch.device, a device name such as 'cuda:0', or an index")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise fail(arg, device, "is no device torch knows") from None
    if factory is None and dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except Exception as e:   # no runtime for it, or no such device index
            raise fail(arg, device, f"cannot allocate there: {e}") from None
    return dev


def check_indexer(indexer, num_layers: int) -> None:
    """``indexer`` is None or an `IndexerSpec` covering at most the pool's layers."""
    if indexer is None:
        return
    if not isinstance(indexer, IndexerSpec):
        raise fail("indexer", indexer, "must be an IndexerSpec or None")
    IndexerSpec.__post_init__(indexer)     # fields set around the constructor
    if indexer.num_layers > num_layers:
        raise fail("indexer.num_layers", indexer.num_layers,
                   f"an indexer covers at most the pool's num_layers={num_layers} layers")
