"""The ``mooncake://`` URL of the Mooncake engine (`kvtier.store.mooncake`, whose
docstring says what each option does)::

    mooncake://MASTER_HOST:PORT[?metadata=p2p&protocol=tcp&device=&segment=0&buffer=16M
                               &staging=64M&transfer=staged&replicas=1&local=HOST]
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict
from urllib.parse import parse_qsl, urlsplit

from kvtier.errors import fail

_SIZE = re.compile(r"^(\d+)([kmgt]?)(i?b)?$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_OPTIONS = ("metadata", "protocol", "device", "segment", "buffer", "staging", "transfer",
            "replicas", "local")


@dataclass(frozen=True)
class MooncakeURL:
    """A parsed ``mooncake://`` URL."""

    host: str
    port: int
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device: str = ""
    segment: int = 0
    buffer: int = 16 << 20
    staging: int = 64 << 20
    transfer: str = "staged"
    replicas: int = 1
    local: str = ""

    @property
    def master(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_url(url: str) -> MooncakeURL:
    """Parse and check a ``mooncake://`` URL; `KvtierError` naming the URL if it is bad."""
    def bad(why: str):
        return fail("url", url, why)

    if not isinstance(url, str):
        raise bad("must be a str")
    parts = urlsplit(url)
    if parts.scheme.lower() != "mooncake":
        raise bad("must start with mooncake://")
    if parts.username is not None or parts.password is not None:
        raise bad("takes no user or password")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise bad("the master's port must be a number from 1 to 65535") from None
    if not host or port is None or port == 0:
        raise bad("must name the master as mooncake://HOST:PORT")
    if parts.path not in ("", "/") or parts.fragment:
        raise bad("takes no path or fragment, only ?option=value&... "
                  f"({', '.join(_OPTIONS)})")
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise bad("options must be ?option=value&...") from None
    seen: Dict[str, str] = {}
    for key, value in pairs:
        if key not in _OPTIONS:
            raise bad(f"unknown option {key!r}; options: {', '.join(_OPTIONS)}")
        if key in seen:
            raise bad(f"option {key!r} is given twice")
        seen[key] = value
    opts = {}
    if "metadata" in seen:
        m = seen["metadata"]
        if m.lower() in ("p2p", "p2phandshake"):
            opts["metadata"] = "P2PHANDSHAKE"
        elif re.match(r"^(https?|etcd)://[^\s/]+", m):
            opts["metadata"] = m
        else:
            raise bad(f"metadata={m!r}: one of p2p, http://host:port/metadata, etcd://host:port")
    if "protocol" in seen:
        if seen["protocol"] not in ("tcp", "rdma"):
            raise bad(f"protocol={seen['protocol']!r}: one of tcp, rdma")
        opts["protocol"] = seen["protocol"]
    if "device" in seen:
        if not re.match(r"^[\w.,:-]*$", seen["device"]):
            raise bad(f"device={seen['device']!r}: device names, comma-separated")
        opts["device"] = seen["device"]
    for key, least in (("segment", 0), ("buffer", 0), ("staging", 1 << 20)):
        if key in seen:
            opts[key] = _size(seen[key], least, key, bad)
    if "transfer" in seen:
        if seen["transfer"] not in ("staged", "direct"):
            raise bad(f"transfer={seen['transfer']!r}: one of staged, direct")
        opts["transfer"] = seen["transfer"]
    if "replicas" in seen:
        r = seen["replicas"]
        if not r.isdigit() or not 1 <= int(r) <= 64:
            raise bad(f"replicas={r!r}: a number from 1 to 64")
        opts["replicas"] = int(r)
    if "local" in seen:
        if not re.match(r"^[\w.:-]+$", seen["local"]):
            raise bad(f"local={seen['local']!r}: a host name or address")
        opts["local"] = seen["local"]
    return MooncakeURL(host=host, port=port, **opts)


def _size(text: str, least: int, key: str, bad) -> int:
    m = _SIZE.match(text.strip())
    if not m:
        raise bad(f"{key}={text!r}: a size in bytes, optionally with K, M, G or T")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < least:
        raise bad(f"{key}={text!r}: at least {least} bytes")
    return value
