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

Layers: a pool holding layers [first, first + L) of a model of ``total`` (a pipeline
stage) stores each page as objects of layer ranges ``L<a>-<b>``: by default the one range
[first, first + L); with a layer split (the store's boundaries, shared by every server),
each range of the split inside the pool's layers. A split that refines every server's
stage boundaries lets stages of any split read each other's pages: each pool reads and
writes whole objects of its own layers (docs/store.md, "Pipeline stages").
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
    holds (None: whole rows), the layers ``(first, count)`` of the pool's it holds
    (None: all), and whether this rank writes it."""

    name: str
    components: Optional[Tuple[str, ...]] = None
    heads: Optional[Tuple[int, int]] = None
    writes: bool = True
    layers: Optional[Tuple[int, int]] = None


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
             layer_split=None, scales: str = "none", kv_dtype: Optional[str] = None) -> Split:
    """The split of `HostPool` ``host``'s pages for this rank.

    tp: (rank, size), None for (0, 1). heads: the model's KV heads (default: the host
    rows' heads times the TP size, which holds unless heads are replicated). layers:
    (first, total): the pool holds layers [first, first + L) of ``total`` (default: all
    of them, first 0). layer_split: the store's layer boundaries ``(0, b1, ..., total)``,
    or an int n for every n layers, the last range short (module doc; None: the pool's
    own range). scales: the quantisation scale layout; kv_dtype: the KV cache dtype's
    name where the rows' dtype does not tell it; both part of the identity."""
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
    spans = _layer_spans(layer_split, first, n_layers, total, comps)
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
    if split_names:
        per = heads // groups
        if local % per or held % per:
            raise fail("tp", tp, f"a rank holding heads {held}..{held + local - 1} splits a group of "
                       f"{per} heads (objects hold gcd(heads, {MAX_GROUPS}) = {groups} groups)")
    parts = []
    for span, cut in spans:
        if split_names:
            parts.extend(Part(f"{span}:h{g}of{groups}", tuple(split_names), (g * per - held, per),
                              replica == 0, cut) for g in range(held // per, (held + local) // per))
        if others:
            parts.append(Part(f"{span}:all", others if split_names else None, None, rank == 0, cut))
    return Split(tuple(parts), identity)


def _layer_spans(layer_split, first: int, n_layers: int, total: int, comps):
    """``(name, layers)`` of each layer range a pool holding layers [first, first +
    n_layers) of ``total`` stores its pages in: ``L<a>-<b>`` and (a - first, b - a),
    or None for the pool's whole range."""
    end = first + n_layers
    if layer_split is None:
        return [(f"L{first}-{end}", None)]
    b = layer_split
    if type(b) is int:          # layers per object from layer 0, the last range short
        if b < 1:
            raise fail("layer_split", layer_split, "must be a positive number of layers per object, "
                       "or the boundaries (0, ..., total)")
        b = (*range(0, total, b), total)
    if (not isinstance(b, (tuple, list)) or len(b) < 2 or any(type(x) is not int for x in b)
            or b[0] != 0 or b[-1] != total or any(x >= y for x, y in zip(b, b[1:]))):
        raise fail("layer_split", layer_split, f"must be increasing ints from 0 to the model's {total} layers")
    if first not in b or end not in b:
        raise fail("layer_split", layer_split, f"must hold the pool's layer boundaries {first} and {end} "
                   "(it refines every server's stages)")
    inside = [x for x in b if first <= x <= end]
    if len(inside) == 2:
        return [(f"L{first}-{end}", None)]
    counts = {c.num_layers for c in comps.values()}
    if len(counts) != 1:
        raise fail("layer_split", layer_split, "cuts the pool's layers, which needs components of one "
                   f"layer count; the host's hold {sorted(counts)}")
    return [(f"L{x}-{y}", (x - first, y - x)) for x, y in zip(inside, inside[1:])]
