"""Which stored objects a rank's host pages are, whatever the writer's topology.

A page is stored as one object per (layer range, KV head group): the KV heads of the
whole model (``heads``) fall into ``G = gcd(heads, 8)`` groups of ``heads / G`` heads,
and a rank's object of group g holds, for each head-split component (`HEAD_SPLIT`: K and
V), every layer of its range and every token of the page, group g's heads only. A rank
at any TP size that divides ``heads`` (or that ``heads`` divides: replicated heads) and
at most 8 holds whole groups, so a writer at TP a and a reader at TP b name the same
objects: the reader reads the groups it holds, one object each, into the head slice of
its own rows. Components that every rank holds whole (MLA's latent and rope, the DSA
indexer's keys and scales) are one object, ``all``.

Writers: a rank writes its objects only where it is the first of the ranks that hold
them (replicated heads: the first rank of each replica set; whole components: TP rank
0), so no object is written twice and no rank writes another's heads.

Layers: a pool holding layers [first, first + L) of a model of ``layers`` (a pipeline
stage) names objects ``L<first>-<first+L>``; a reader of another stage split misses
them (docs/store.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from kvtier.errors import fail

from .page import HEAD_SPLIT, MAX_GROUPS, Identity


@dataclass(frozen=True)
class Part:
    """One object of each page: the suffix of its key, the components it holds (None:
    all), the heads ``(first, count)`` of the head-split components' local rows it
    holds (None: whole rows), and whether this rank writes it."""

    name: str
    components: Optional[Tuple[str, ...]] = None
    heads: Optional[Tuple[int, int]] = None
    writes: bool = True


@dataclass(frozen=True)
class Split:
    """A rank's objects of each page (`parts`, in key order) and the identity they are
    named by."""

    parts: Tuple[Part, ...]
    identity: Identity


def _pair(arg: str, value, default):
    if value is None:
        return default
    ok = (isinstance(value, tuple) and len(value) == 2 and all(type(x) is int for x in value))
    if not ok:
        raise fail(arg, value, "must be a tuple of two ints, or None")
    return value


def split_of(host, *, model: str, tp=None, heads: Optional[int] = None, layers=None,
             scales: str = "none", kv_dtype: Optional[str] = None) -> Split:
    """The split of `HostPool` ``host``'s pages for this rank.

    tp: (rank, size), None for (0, 1). heads: the model's KV heads (default: the host
    rows' heads times the TP size, which holds unless heads are replicated). layers:
    (first, total): the pool holds layers [first, first + L) of ``total`` (default: all
    of them, first 0). scales: the quantisation scale layout; kv_dtype: the KV cache
    dtype's name where the rows' dtype does not tell it; both part of the identity."""
    rank, size = _pair("tp", tp, (0, 1))
    if not 0 <= rank < size:
        raise fail("tp", tp, "must be (rank, size) with 0 <= rank < size")
    comps = host.components
    n_layers = max(c.num_layers for c in comps.values())
    first, total = _pair("layers", layers, (0, n_layers))
    if not (0 <= first and first + n_layers <= total):
        raise fail("layers", layers, f"must be (first, total) with 0 <= first and first + {n_layers} "
                   "(the pool's layers) <= total")
    if not isinstance(scales, str) or not scales:
        raise fail("scales", scales, "must be a non-empty str naming the scale layout")
    if kv_dtype is not None and (not isinstance(kv_dtype, str) or not kv_dtype):
        raise fail("kv_dtype", kv_dtype, "must be a non-empty str naming the KV cache dtype, or None")
    span = f"L{first}-{first + n_layers}"
    split_names = [n for n in HEAD_SPLIT if n in comps]
    local = None
    if split_names:
        counts = {comps[n].row_shape[0] if len(comps[n].row_shape) > 1 else 1 for n in split_names}
        if len(counts) != 1:
            raise fail("host", sorted(counts), f"{'/'.join(split_names)} rows must hold one number of heads")
        local = counts.pop()
        heads = local * size if heads is None else heads
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise fail("heads", heads, "must be a positive int (the model's KV heads)")
        if size <= heads:
            if heads % size or local != heads // size:
                raise fail("heads", heads, f"at TP size {size} a rank holds heads/{size} heads; "
                           f"the host rows hold {local}")
            held, replica = rank * local, 0
        else:
            if size % heads or local != 1:
                raise fail("heads", heads, f"at TP size {size} > heads each rank holds one head; "
                           f"the host rows hold {local}")
            held, replica = rank // (size // heads), rank % (size // heads)
    groups = math.gcd(heads, MAX_GROUPS) if split_names else 1
    whole = []
    for n in sorted(comps):
        c = comps[n]
        shape = (heads, *c.row_shape[1:]) if n in split_names and len(c.row_shape) > 1 else (
            (heads * c.row_shape[0],) if n in split_names else tuple(c.row_shape))
        whole.append((n, str(c.dtype).replace("torch.", ""), shape))
    identity = Identity(model, host.page_size, total, tuple(whole), scales, kv_dtype or "")
    others = tuple(n for n in comps if n not in split_names)
    shared = (Part(f"{span}:all", others if split_names else None, None, rank == 0),) if others else ()
    if not split_names:
        return Split(shared, identity)
    per = heads // groups
    if local % per or held % per:
        raise fail("tp", tp, f"a rank holding heads {held}..{held + local - 1} splits a group of "
                   f"{per} heads (objects hold gcd(heads, {MAX_GROUPS}) = {groups} groups)")
    parts = tuple(Part(f"{span}:h{g}of{groups}", tuple(split_names), (g * per - held, per), replica == 0)
                  for g in range(held // per, (held + local) // per))
    return Split(parts + shared, identity)
