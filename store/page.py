"""A stored object: a header and the payload of a part of a page (`kvtier.store.split`:
a page is one object per KV head group and one for the components every rank holds).

Payload (canonical order, independent of the host layout): for each component of the
object in `Geometry.components` order, for each of its layers, the page's token rows
(cut to the object's heads) in order::

    payload = concat over components c, layers l < L_c, tokens t < P: row(c, l, t)

so one component of one page is ``L_c * P * row_bytes_c`` bytes, and a
``page_first_direct`` host page of one component of whole rows is one contiguous piece.

Header (little-endian; every field but the checksum and its algorithm is a function of
the reader's own geometry and key, so a reader builds the header it expects and compares)::

    0   magic          8s   b"KVTIERPG"
    8   version        u16  FORMAT_VERSION
    10  algorithm      u16  checksum algorithm id (ALGORITHMS)
    12  header_len     u32  bytes of the whole header, a multiple of 8
    16  payload_len    u64
    24  geometry_len   u32
    28  key_len        u32
    32  checksum       u64  of the payload (`Checksum`)
    40  geometry       utf-8 `Geometry.text` (identity, part, rows)
        key            utf-8, the namespaced key the object is stored under
        padding        zero bytes to header_len

Keys: SGLang's page keys hash token ids only, so an object's key is
``namespace:page_key:part`` (`object_key`), the namespace naming the model and the
fingerprint of its `Identity` (`namespace`): a bf16 and an fp8 server of one model, or
two revisions, never share objects.
"""
from __future__ import annotations

import hashlib
import logging
import struct
import zlib
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple
from urllib.parse import quote

import torch

from kvtier.errors import fail
from kvtier.warn_once import warn_once as warn_once_any

log = logging.getLogger("kvtier")

MAGIC = b"KVTIERPG"
FORMAT_VERSION = 2
_FIXED = struct.Struct("<8sHHIQIIQ")        # magic .. checksum: 40 bytes
assert _FIXED.size == 40
_ALGO_AT, _CHECKSUM_AT = 10, 32


# ---------------------------------------------------------------------- checksums
XXH3_64 = 1      # xxhash's xxh3_64 (the `store` extra): the default
CRC32 = 2        # zlib.crc32 (standard library): the fallback where xxhash is missing
ALGORITHMS = {XXH3_64: "xxh3_64", CRC32: "crc32"}

def warn_once(mode: str, message: str, *args) -> None:
    """One WARNING per failure mode per process on the ``kvtier`` logger."""
    warn_once_any("store." + mode, "kvtier store: " + message, *args)


def _xxhash():
    try:
        import xxhash
        return xxhash
    except ImportError:
        return None


class Checksum:
    """Checksums of a payload given as pieces (buffers), computed over the pieces in
    place: no piece is copied or joined."""

    def __init__(self):
        self._xxhash = _xxhash()

    @property
    def default(self) -> int:
        """The algorithm a writer uses: xxh3_64, else crc32 (one WARNING)."""
        if self._xxhash is not None:
            return XXH3_64
        warn_once("checksum.fallback", "xxhash is not installed; pages are checksummed with zlib's "
                  "crc32, which is slower (pip install 'kvtier[store]')")
        return CRC32

    def can(self, algorithm: int) -> bool:
        return algorithm == CRC32 or (algorithm == XXH3_64 and self._xxhash is not None)

    def of(self, algorithm: int, pieces: Sequence[memoryview]) -> int:
        if algorithm == XXH3_64:
            x = self._xxhash
            if len(pieces) == 1:
                return x.xxh3_64_intdigest(pieces[0])
            h = x.xxh3_64()
            for p in pieces:
                h.update(p)
            return h.intdigest()
        if algorithm == CRC32:
            c = 0
            for p in pieces:
                c = zlib.crc32(p, c)
            return c
        raise fail("algorithm", algorithm, f"must be one of {ALGORITHMS}")

    def matches(self, algorithm: int, pieces: Sequence[memoryview], stored: int) -> bool:
        """Whether the payload ``pieces`` has the checksum ``stored``."""
        return self.of(algorithm, pieces) == stored


# ---------------------------------------------------------------------- geometry
_ORDER = ("k", "v", "kv", "latent", "rope", "index_k", "index_scale")


@dataclass(frozen=True)
class ComponentShape:
    """One component as the payload holds it."""

    name: str
    num_layers: int
    row_shape: Tuple[int, ...]
    dtype: str              # torch dtype name without "torch."
    row_bytes: int

    def text(self) -> str:
        return f"{self.name}={self.dtype}[{','.join(map(str, self.row_shape))}]x{self.num_layers}"


@dataclass(frozen=True)
class Geometry:
    """What a page holds: the page size and each component's layers and rows, in the
    payload's fixed component order (k, v, kv, latent, rope, index_k, index_scale, then
    any other name in alphabetical order)."""

    page_size: int
    components: Tuple[ComponentShape, ...]
    scope: str = ""         # what the rows are a part of: the identity and the object's layers and heads
    # the payload's length, derived once (every call frames its pages by it)
    payload_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "payload_bytes", sum(self.component_bytes(c) for c in self.components))

    @classmethod
    def of(cls, host) -> "Geometry":
        """The geometry of a `kvtier.pool.HostPool` (every component, layers packed)."""
        comps = sorted(host.components.values(),
                       key=lambda c: (_ORDER.index(c.name) if c.name in _ORDER else len(_ORDER), c.name))
        return cls(host.page_size, tuple(
            ComponentShape(c.name, c.num_layers, tuple(c.row_shape), str(c.dtype).replace("torch.", ""),
                           c.row_bytes) for c in comps))

    @property
    def text(self) -> str:
        """The geometry as the header holds it, e.g. ``<scope>|page=16;k=bfloat16[2,128]x32;v=...``."""
        rows = f"page={self.page_size};" + ";".join(c.text() for c in self.components)
        return f"{self.scope}|{rows}" if self.scope else rows

    def component_bytes(self, c: ComponentShape) -> int:
        return c.num_layers * self.page_size * c.row_bytes

    def offsets(self) -> dict:
        """Each component's first byte in the payload."""
        out, off = {}, 0
        for c in self.components:
            out[c.name] = off
            off += self.component_bytes(c)
        return out


# ---------------------------------------------------------------------- identity, namespaces, keys
HEAD_SPLIT = ("k", "v")     # components whose rows are a rank's KV heads (MHA); the rest are whole on every rank
MAX_GROUPS = 8              # a page's head-split components are stored in gcd(heads, 8) head groups


@dataclass(frozen=True)
class Identity:
    """What makes a page's bytes meaningful, independent of how the writer was split:
    the model (name, revision or a caller-given id), the page size, the model's layer
    count, each component's dtype and whole-model row shape (every KV head), the
    quantisation scale layout, and the KV cache dtype's name where the rows' dtype does
    not tell it (fp8 kept as uint8). Two pools share objects only where every field is
    equal (`fingerprint`); readers also compare the whole `text` in each object's header."""

    model: str
    page_size: int
    layers: int
    components: Tuple[Tuple[str, str, Tuple[int, ...]], ...]    # (name, dtype, whole row shape)
    scales: str = "none"
    kv_dtype: str = ""

    @property
    def text(self) -> str:
        comps = ";".join(f"{n}={d}[{','.join(map(str, r))}]" for n, d, r in self.components)
        kv = f";kv={self.kv_dtype}" if self.kv_dtype else ""
        return f"model={self.model};page={self.page_size};layers={self.layers};{comps};scales={self.scales}{kv}"

    @property
    def fingerprint(self) -> str:
        """16 hex digits of BLAKE2b of `text`."""
        return hashlib.blake2b(self.text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def namespace(identity: Identity) -> str:
    """The namespace of an identity's objects: ``kvtier2:<model>:<fingerprint>``.

    The model is percent-encoded outside ``[A-Za-z0-9._~/@-]`` (so ``:`` only separates,
    and no ``{`` makes a Redis Cluster hash tag)."""
    if not isinstance(identity.model, str) or not identity.model:
        raise fail("model", identity.model, "must be a non-empty str naming the model")
    return f"kvtier2:{quote(identity.model, safe='/-._~@')}:{identity.fingerprint}"


def object_key(ns: str, page_key: str, part: str) -> str:
    """The key of one object of a page: namespace, the engine's page key, and the part
    of the page it holds (``L<first>-<end>:h<group>of<groups>`` or ``L<first>-<end>:all``)."""
    return f"{ns}:{page_key}:{part}"


# ---------------------------------------------------------------------- headers
def header_len(geometry_bytes: int, key_bytes: int) -> int:
    return -(-(_FIXED.size + geometry_bytes + key_bytes) // 8) * 8


class PageFormat:
    """Headers of one geometry: built for a writer, verified for a reader."""

    def __init__(self, geometry: Geometry, checksum: Optional[Checksum] = None):
        self.geometry = geometry
        self.geometry_text = geometry.text.encode()
        self.payload_bytes = geometry.payload_bytes
        self.checksum = checksum or Checksum()

    def header_size(self, key: str) -> int:
        return header_len(len(self.geometry_text), len(key.encode("utf-8", "surrogatepass")))

    def header(self, key: str, algorithm: int = 0, checksum: int = 0) -> bytearray:
        """The header of ``key``'s object (with its checksum, where given)."""
        k = key.encode("utf-8", "surrogatepass")
        n = header_len(len(self.geometry_text), len(k))
        out = bytearray(n)
        _FIXED.pack_into(out, 0, MAGIC, FORMAT_VERSION, algorithm, n, self.payload_bytes,
                         len(self.geometry_text), len(k), checksum)
        out[_FIXED.size:_FIXED.size + len(self.geometry_text)] = self.geometry_text
        out[_FIXED.size + len(self.geometry_text):_FIXED.size + len(self.geometry_text) + len(k)] = k
        return out

    def seal(self, key: str, pieces: Sequence[memoryview], algorithm: Optional[int] = None) -> bytearray:
        """The header of ``key``'s object whose payload is ``pieces`` (checksummed in place)."""
        return self.seal_into(self.header(key), pieces, algorithm)

    def seal_into(self, header: bytearray, pieces: Sequence[memoryview],
                  algorithm: Optional[int] = None) -> bytearray:
        """Complete ``header`` (from `header`, which leaves the algorithm 0: a page no
        reader accepts) with the checksum of the payload ``pieces``; returns it."""
        algorithm = self.checksum.default if algorithm is None else algorithm
        checksum = self.checksum.of(algorithm, pieces)
        struct.pack_into("<Q", header, _CHECKSUM_AT, checksum)
        struct.pack_into("<H", header, _ALGO_AT, algorithm)
        return header

    def verify(self, key: str, header, pieces: Sequence[memoryview]) -> Optional[str]:
        """None where ``header`` and the payload ``pieces`` read for ``key`` are a whole,
        intact page of this geometry; else what failed: "magic", "version", "length",
        "geometry", "key", "algorithm" (unknown), "unverifiable" (known, not installed),
        "checksum"."""
        h = bytes(header)
        k = key.encode("utf-8", "surrogatepass")
        gt = self.geometry_text
        n = header_len(len(gt), len(k))
        if len(h) != n:
            return "length"
        magic, version, algorithm, size, payload, g_len, k_len, stored = _FIXED.unpack_from(h)
        if magic != MAGIC:
            return "magic"
        if version != FORMAT_VERSION:
            return "version"
        if size != n or payload != self.payload_bytes:
            return "length"
        if g_len != len(gt):
            return "geometry"
        if k_len != len(k):
            return "key"
        g1 = _FIXED.size + len(gt)
        if h[_FIXED.size:g1] != gt:
            return "geometry"
        if h[g1:g1 + len(k)] != k or h[g1 + len(k):].strip(b"\0"):      # the key, then zero padding
            return "key"
        if algorithm not in ALGORITHMS:
            return "algorithm"
        if not self.checksum.can(algorithm):
            return "unverifiable"
        if not self.checksum.matches(algorithm, pieces, stored):
            return "checksum"
        return None


def as_bytes_view(t: torch.Tensor) -> memoryview:
    """A writable, flat byte view of a contiguous CPU tensor's memory (no copy)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise fail("t", (tuple(t.shape), str(t.device)), "must be a contiguous CPU tensor")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
