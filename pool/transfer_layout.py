"""Prefill-decode transfer check: both sides must agree on the layout before a byte is
sent, or the receiver would read rows of the wrong size or layer."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Tuple, Union

from kvtier.errors import fail
from kvtier.kernels.validate import is_int


@dataclass(frozen=True)
class TransferLayout:
    """What a transfer peer must match.

    item_bytes: bytes of one transferred item per component (a row, or a page of rows),
        in the pool's component order.
    num_layers: layers per component (the first component's; indexers may differ).
    attn_tp_size: attention tensor-parallel size (heads are split across ranks).
    num_regions: registered memory regions (one per component per layer).
    """

    item_bytes: Tuple[int, ...]
    num_layers: int
    attn_tp_size: int
    num_regions: int

    def to_dict(self) -> dict:
        return asdict(self)


def transfer_layout(pool, *, attn_tp_size: int = 1, by_page: bool = True) -> TransferLayout:
    if not is_int(attn_tp_size) or attn_tp_size <= 0:
        raise fail("attn_tp_size", attn_tp_size, "must be a positive int")
    if not isinstance(by_page, bool):
        raise fail("by_page", by_page, "must be True or False")
    comps = pool.spec()
    per = pool.page_size if by_page else 1
    return TransferLayout(item_bytes=tuple(c.row_bytes * per for c in comps),
                          num_layers=pool.num_layers, attn_tp_size=attn_tp_size,
                          num_regions=sum(c.num_layers for c in comps))


def check_transfer_layout(pool, remote: Union[TransferLayout, dict], *, attn_tp_size: int = 1,
                          by_page: bool = True) -> None:
    """Raise `KvtierError` naming the first field where ``remote`` (a `TransferLayout`, or
    its ``to_dict()`` received from the peer) differs from this pool's layout.

    ``remote`` is checked as untrusted data first: its keys must be exactly the field
    names, ``item_bytes`` a list or tuple of ints and the other fields ints (a bool or a
    float such as 2.0 is no count); a malformed one raises `KvtierError` naming
    ``remote.<field>`` and the value, never a TypeError."""
    local = transfer_layout(pool, attn_tp_size=attn_tp_size, by_page=by_page)
    if isinstance(remote, TransferLayout):
        remote = remote.to_dict()
    if not isinstance(remote, dict):
        raise fail("remote", type(remote).__name__, "must be a TransferLayout or its to_dict()")
    names = [f.name for f in fields(TransferLayout)]
    for key in remote:
        if not isinstance(key, str) or key not in names:
            raise fail("remote", key, f"is no TransferLayout field; the fields are {names}")
    for name in names:
        if name not in remote:
            raise fail("remote", sorted(remote), f"lacks {name!r}")
        theirs = remote[name]
        if name == "item_bytes":
            if not isinstance(theirs, (list, tuple)) or not all(is_int(b) and b >= 0 for b in theirs):
                raise fail(f"remote.{name}", theirs, "must be a list of non-negative ints (bytes per component)")
        elif not is_int(theirs) or theirs < 0:
            raise fail(f"remote.{name}", theirs, "must be a non-negative int")
    for name in names:
        theirs, ours = remote[name], getattr(local, name)
        if (tuple(theirs) if isinstance(ours, tuple) else theirs) != ours:
            raise fail(f"remote.{name}", theirs, f"this side has {ours}; the layouts must match "
                       "before anything is sent")
