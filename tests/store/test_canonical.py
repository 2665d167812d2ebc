"""Host pages <-> canonical payloads: every kind and layout against a plain-torch model
of the canonical order; pieces in place where the layout allows (no copy); the staged
page copy against kvtier's row copy reference on the same maps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from store_support import KINDS, LAYOUTS, PAGE, POISON, canonical, host_case, slots
from kvtier.kernels.reference import copy_rows_reference
from kvtier.store.canonical import CanonicalPages, Staged, modes


def _joined(pieces) -> bytes:
    return b"".join(bytes(p) for p in pieces)


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("piece_min", [0, 1 << 30])
def test_payload_is_canonical(kind, layout, piece_min):
    hc = host_case(kind, layout)
    host = hc.host
    plan = CanonicalPages(host, layer_piece_min=piece_min)
    pages = [7, 2, 3, 11]               # out of order, with a run (2, 3)
    staging = plan.take_staging(len(pages))
    plan.to_staging(pages, staging)
    for j, p in enumerate(pages):
        pieces = plan.pieces(p, staging, j)
        assert sum(v.nbytes for v in pieces) == plan.payload_bytes == host.page_bytes
        assert _joined(pieces) == canonical(host, p * PAGE), f"page {p}"
    hc.check_margins()


@pytest.mark.parametrize("kind", KINDS)
def test_modes_follow_the_layout(kind):
    expect = {"page_first_direct": "whole", "page_first": "staged", "page_head": "staged"}
    for layout in LAYOUTS:
        host = host_case(kind, layout).host
        small = modes(CanonicalPages(host))                      # pages of a few hundred bytes
        every = modes(CanonicalPages(host, layer_piece_min=0))
        want = expect.get(layout)
        if want:
            assert set(small.values()) == set(every.values()) == {want}, (layout, small)
        else:   # layer_first: a piece per layer where pieces are large enough
            assert set(small.values()) == {"staged"} and set(every.values()) == {"layers"}


def test_one_token_pages_of_page_first_are_whole():
    from pool_support import DeviceCase, HostCase
    dev = DeviceCase("mha", "layers", 1, layers=3, size=4)
    host = HostCase(dev.pool, "page_first", "auto", size_tokens=8).host
    assert set(modes(CanonicalPages(host)).values()) == {"whole"}


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
def test_in_place_pieces_are_host_memory(layout):
    host = host_case("mha_v_indexer", layout).host
    plan = CanonicalPages(host, layer_piece_min=0)
    assert plan.in_place and plan.take_staging(3) is None
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in host.buffers.values()]
    for v in plan.pieces(5, None, 0):
        a = _address(v)
        assert any(lo <= a and a + v.nbytes <= hi for lo, hi in spans)
    # Writing through a piece writes the host page itself.
    pieces = plan.pieces(5, None, 0)
    before = host.get_page(5 * PAGE).clone()
    pieces[0][0] = (pieces[0][0] + 1) % 256
    assert not torch.equal(host.get_page(5 * PAGE), before)


@pytest.mark.parametrize("layout", ["page_first", "page_head", "layer_first"])
@pytest.mark.parametrize("kind", KINDS)
def test_from_staging_writes_only_the_pages_given(kind, layout):
    hc = host_case(kind, layout)
    host = hc.host
    plan = CanonicalPages(host)
    src = [1, 4, 5]
    want = [canonical(host, p * PAGE) for p in src]
    staging = plan.take_staging(len(src))
    plan.to_staging(src, staging)
    for b in host.buffers.values():
        b.view(-1).view(torch.uint8).fill_(POISON)
    dst = [9, 10, 0]
    plan.from_staging(staging, dst)
    for q in range(host.size // PAGE):
        page = host.get_page(q * PAGE)
        if q in dst:
            assert canonical(host, q * PAGE) == want[dst.index(q)], f"page {q}"
        else:
            assert bool((page == POISON).all()), f"page {q} was written"
    hc.check_margins()


@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_page_copy_matches_the_row_copy_reference(layout):
    """The staged copy and `copy_rows_reference` over the same two maps agree byte for
    byte, and neither writes a slot's header room."""
    host = host_case("mla_split_indexer", layout).host
    plan = CanonicalPages(host)
    pages = [3, 8, 9, 1]
    ours = plan.take_staging(len(pages))
    theirs = plan.take_staging(len(pages))
    assert ours is not theirs
    ours.tensor.fill_(1)
    theirs.tensor.fill_(2)
    plan.to_staging(pages, ours)
    dst = torch.arange(len(pages) * PAGE)
    for (_, host_map), smap in zip(plan.copy_groups, theirs.maps):
        copy_rows_reference(host_map, slots(pages), smap, dst, by_page=True)
    room = plan.objects[0].header_room
    assert room > 0
    assert torch.equal(ours.tensor[:len(pages), room:], theirs.tensor[:len(pages), room:])
    assert (ours.tensor[:, :room] == 1).all() and (theirs.tensor[:, :room] == 2).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_page_staged_whole_has_its_header_room_before_its_payload(kind, layout):
    """Where every component is staged, a slot holds a header of up to the room's size
    just before the payload, as one buffer; elsewhere there is no such buffer."""
    host = host_case(kind, layout).host
    plan = CanonicalPages(host)
    pages = [6, 2]
    staging = plan.take_staging(len(pages))
    whole_staged = set(modes(plan).values()) == {"staged"}
    assert (plan.objects[0].header_room > 0) == whole_staged
    if not whole_staged:
        assert plan.framed(staging, 0, 8) is None
        return
    plan.to_staging(pages, staging)
    for j, p in enumerate(pages):
        for n in (8, 64, plan.objects[0].header_room):
            header, (view,) = frame = plan.framed(staging, j, n)
            assert view.nbytes == n + plan.payload_bytes and header.nbytes == n
            assert _address(header) == _address(view)
            assert bytes(view[n:]) == canonical(host, p * PAGE) == _joined(plan.pieces(p, staging, j))
            assert _address(view) + n == _address(plan.pieces(p, staging, j)[0])
            assert plan.framed(staging, j, n) is frame      # made once per staging buffer: a call makes none
        assert plan.framed(staging, j, plan.objects[0].header_room + 8) is None     # a longer key's header
    assert plan.pieces(pages[0], staging, 0) is plan.pieces(pages[0], staging, 0)


def test_staging_buffers_are_reused():
    plan = CanonicalPages(host_case("mha", "page_first").host)
    a = plan.take_staging(4)
    plan.give_staging(a)
    assert plan.take_staging(3) is a          # large enough: reused
    b = plan.take_staging(2)                  # a is out: a new one
    assert b is not a


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_folded_copies_move_the_bytes_of_the_object_by_object_copies(kind, layout):
    """A page of several head-group objects is staged and placed with alike objects'
    copies folded into one (`Staging.fused`): the staging slots and the host pages end
    byte for byte as the object-by-object copies leave them, and no other byte moves."""
    from kvtier.store.canonical import copy_pages
    from kvtier.store.split import split_of
    hc = host_case(kind, layout)
    host = hc.host
    plan = CanonicalPages(host, parts=split_of(host, model="m").parts)
    if plan.in_place:
        pytest.skip("nothing staged")
    src, dst = [1, 4, 5, 7], [9, 10, 0, 2]
    want = [canonical(host, p * PAGE) for p in src]
    staged_whole = all(type(c) is Staged for o in plan.objects for c in o.components)
    folded, single = plan.take_staging(len(src)), plan.take_staging(len(src))
    if len(plan.objects) > 1 and kind == "mha":
        assert len(folded.fused) < len(folded.views)        # the head groups fold
    for s in (folded, single):
        s.tensor.fill_(POISON)
    plan.to_staging(src, folded)
    for host_v, staging_v in single.views:
        copy_pages(host_v, src, staging_v, range(len(src)))
    assert torch.equal(folded.tensor, single.tensor)
    assert not (folded.tensor[:len(src)] == POISON).all()
    for b in host.buffers.values():
        b.view(-1).view(torch.uint8).fill_(POISON)
    plan.from_staging(folded, dst)
    by_folded = {n: b.view(-1).view(torch.uint8).clone() for n, b in host.buffers.items()}
    for b in host.buffers.values():
        b.view(-1).view(torch.uint8).fill_(POISON)
    for host_v, staging_v in single.views:
        copy_pages(staging_v, range(len(src)), host_v, dst)
    for n, b in host.buffers.items():
        assert torch.equal(by_folded[n], b.view(-1).view(torch.uint8)), n
    for q in range(host.size // PAGE):
        page = host.get_page(q * PAGE)
        if q in dst:
            if staged_whole:        # else its in-place components are not the copies' to move
                assert canonical(host, q * PAGE) == want[dst.index(q)], f"page {q}"
        else:
            assert bool((page == POISON).all()), f"page {q} was written"
    hc.check_margins()


def test_a_staging_buffer_keeps_the_frames_of_every_object_of_a_page():
    """Pages of more objects than `FRAME_LENGTHS` (one a layer here) keep every object's
    frames: a call finds them all made (a bound per staging buffer alone would drop
    each object's frames before the next call reached it, and make them every call).
    Here an object holds one layer of one head."""
    from kvtier.pool import HostPool, MHADevicePool
    from kvtier.store.canonical import FRAME_LENGTHS
    from kvtier.store.split import split_of
    layers = FRAME_LENGTHS + 4
    dev = MHADevicePool(4, 4, layers, 2, 16, dtype=torch.bfloat16)
    host = HostPool(dev, layout="page_first", size_tokens=16, pin_memory=False)
    plan = CanonicalPages(host, parts=split_of(host, model="m", layer_split=1).parts)
    m = len(plan.objects)
    assert m == 2 * layers
    staging = plan.take_staging(2)
    first = [[plan.framed(staging, j, 64, o) for j in range(2)] for o in range(m)]
    again = [[plan.framed(staging, j, 64, o) for j in range(2)] for o in range(m)]
    assert all(a is b for fa, fb in zip(first, again) for a, b in zip(fa, fb))
