"""The page object: header fields, what a reader verifies and how each failure is
named, checksums over pieces, the crc32 fallback, namespaces."""
from __future__ import annotations

import logging
import struct

import pytest

import kvtier.warn_once

from store_support import host_case
from kvtier.errors import KvtierError
from kvtier.store import page as page_mod
from kvtier.store.page import (CRC32, FORMAT_VERSION, MAGIC, XXH3_64, Checksum, Geometry, Identity,
                               PageFormat, namespace, object_key)


@pytest.fixture
def fmt():
    return PageFormat(Geometry.of(host_case("mha_v_indexer", "page_first").host))


def _payload(fmt, seed=1):
    import random
    data = bytearray(random.Random(seed).randbytes(fmt.payload_bytes))
    mv = memoryview(data)
    return data, [mv[:100], mv[100:101], mv[101:]]


def test_header_fields(fmt):
    data, pieces = _payload(fmt)
    h = fmt.seal("ns:key", pieces)
    magic, version, algo, hlen, plen, glen, klen, checksum = struct.unpack_from("<8sHHIQIIQ", h)
    assert (magic, version, algo, hlen, plen) == (MAGIC, FORMAT_VERSION, XXH3_64, len(h), fmt.payload_bytes)
    assert hlen % 8 == 0
    text = bytes(h[40:40 + glen]).decode()
    assert text == fmt.geometry.text and text.startswith("page=4;k=float16[2,8]x3;v=float16[2,4]x3;index_k=uint8[16]x2")
    assert bytes(h[40 + glen:40 + glen + klen]) == b"ns:key"
    assert checksum == Checksum().of(XXH3_64, [memoryview(data)])     # pieces or whole: the same
    assert fmt.verify("ns:key", h, pieces) is None


@pytest.mark.parametrize("field,offset,why", [
    ("magic", 0, "magic"), ("version", 8, "version"), ("algorithm", 10, "algorithm"),
    ("header_len", 12, "length"), ("payload_len", 16, "length"), ("geometry_len", 24, "geometry"),
    ("key_len", 28, "key"), ("checksum", 32, "checksum"), ("geometry text", 45, "geometry"),
])
def test_each_header_field_is_verified(fmt, field, offset, why):
    data, pieces = _payload(fmt)
    h = fmt.seal("ns:key", pieces)
    h[offset] ^= 0x40
    assert fmt.verify("ns:key", h, pieces) == why, field


def test_key_and_payload_are_verified(fmt):
    data, pieces = _payload(fmt)
    h = fmt.seal("ns:key-1", pieces)
    assert fmt.verify("ns:key-2", h, pieces) == "key"          # swapped between keys
    assert fmt.verify("ns:key-10", h, pieces) == "key"          # one byte longer: same padded size
    assert fmt.verify("ns:key-1-and-longer", h, pieces) == "length"
    data[len(data) // 2] ^= 1
    assert fmt.verify("ns:key-1", h, pieces) == "checksum"
    assert fmt.verify("ns:key-1", h[:-8], pieces) == "length"


def test_another_geometry_is_refused(fmt):
    other = PageFormat(Geometry.of(host_case("mha", "page_first").host))
    _, pieces = _payload(other)
    h = other.seal("ns:key", pieces)
    assert fmt.verify("ns:key", h, pieces) in ("length", "geometry")
    # Same sizes, another dtype: only the geometry text tells them apart.
    import torch
    a = Geometry(4, (page_mod.ComponentShape("k", 2, (8,), "float16", 16),))
    b = Geometry(4, (page_mod.ComponentShape("k", 2, (8,), "bfloat1", 16),))     # a same-length name
    fa, fb = PageFormat(a), PageFormat(b)
    _, pieces = _payload(fa)
    assert fa.header_size("x") == fb.header_size("x")
    assert fb.verify("x", fa.seal("x", pieces), pieces) == "geometry"
    assert torch.float16 is not None


def test_crc32_fallback_and_unverifiable_pages(fmt, monkeypatch, caplog):
    data, pieces = _payload(fmt)
    with_xxh3 = fmt.seal("k", pieces)
    monkeypatch.setattr(page_mod, "_xxhash", lambda: None)
    kvtier.warn_once.forget("store.checksum.fallback")
    bare = PageFormat(fmt.geometry)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        h = bare.seal("k", pieces)
        bare.seal("k", pieces)
    assert [r.getMessage() for r in caplog.records].count(
        "kvtier store: xxhash is not installed; pages are checksummed with zlib's crc32, which is slower "
        "(pip install 'kvtier[store]')") == 1
    assert struct.unpack_from("<H", h, 10)[0] == CRC32
    assert bare.verify("k", h, pieces) is None
    assert fmt.verify("k", h, pieces) is None                   # a reader with xxhash reads crc32 pages
    assert bare.verify("k", with_xxh3, pieces) == "unverifiable"
    data[0] ^= 1
    assert bare.verify("k", h, pieces) == "checksum"


def test_checksum_of_pieces_equals_checksum_of_the_whole():
    import random
    data = bytearray(random.Random(3).randbytes(100_003))
    mv = memoryview(data)
    cuts = [mv[:1], mv[1:65536], mv[65536:65537], mv[65537:]]
    c = Checksum()
    for algo in (XXH3_64, CRC32):
        assert c.of(algo, cuts) == c.of(algo, [mv])
    with pytest.raises(KvtierError, match="algorithm"):
        c.of(99, [mv])


def test_namespace_and_key_format():
    ident = Identity("org/Model {v2}:x@rev1", 4, 32, (("k", "float16", (8, 128)),))
    ns = namespace(ident)
    assert ns == f"kvtier2:org/Model%20%7Bv2%7D%3Ax@rev1:{ident.fingerprint}"
    assert len(ident.fingerprint) == 16 and int(ident.fingerprint, 16) >= 0
    assert ident.text == "model=org/Model {v2}:x@rev1;page=4;layers=32;k=float16[8,128];scales=none"
    assert object_key(ns, "abc", "L0-32:h1of8") == ns + ":abc:L0-32:h1of8"
    with pytest.raises(KvtierError, match="model"):
        namespace(Identity("", 4, 32, ()))


def test_fingerprints_differ_by_every_field():
    base = dict(model="m@r", page_size=4, layers=3, components=(("k", "float16", (8, 8)),), scales="none")
    changes = [("model", "m@s"), ("page_size", 8), ("layers", 4), ("components", (("k", "bfloat16", (8, 8)),)),
               ("components", (("k", "float16", (4, 8)),)), ("scales", "per-token")]
    prints = {Identity(**base).fingerprint}
    for field, value in changes:
        prints.add(Identity(**{**base, field: value}).fingerprint)
    assert len(prints) == len(changes) + 1
