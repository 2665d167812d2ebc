"""Redis / Valkey store URLs.

    redis://[[user]:password@]host[:port][/db][?connections=N]
    redis+cluster://[[user]:password@]host[:port][,host[:port]...][?connections=N]
    rediss://...[?connections=N][&ca=PATH][&cert=PATH[&key=PATH]][&verify=required|none]
    rediss+cluster://...  (the same options)

``valkey://`` and ``valkey+cluster://`` are the same, ``valkeys://`` and
``valkeys+cluster://`` the same over TLS. The port defaults to 6379; an
IPv6 host is written in brackets. ``connections`` is how many connections one call
spreads its keys over, each driven by its own thread, shared by the nodes the call
reaches in proportion to their keys, at least one a node and at most one per 2 MiB of a
node's values (`kvtier.store.redis.SPREAD_BYTES`) (default 4: the most robust
for writes to one node on a busy 2-core machine, where reads did as well over 1;
docs/store-redis.md).
A cluster has one database, so its URL names none.

Over TLS (`kvtier.store.redis_tls`): ``ca`` is a PEM file of the certificates that may
sign the server's (default: the system's trusted ones), ``cert`` and ``key`` the client's
certificate and its key (``key`` left out: in the ``cert`` file), ``verify`` whether the
server's certificate must be signed by one of them and name the URL's host (``required``,
the default) or is not checked at all (``none``). A plain URL takes none of these."""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple
from urllib.parse import parse_qsl, unquote, urlsplit

from kvtier.errors import fail

DEFAULT_PORT = 6379
OPTIONS = {"connections": (1, 64)}      # name -> (least, most)
TLS_OPTIONS = ("ca", "cert", "key", "verify")
VERIFY = ("required", "none")
TLS_SCHEMES = ("rediss", "valkeys")


class RedisUrl(NamedTuple):
    addrs: List[Tuple[str, int]]
    username: Optional[str]
    password: Optional[str]
    db: int
    connections: int
    tls: bool = False               # rediss:// (valkeys://)
    ca: Optional[str] = None        # PEM file of trusted CAs (None: the system's)
    cert: Optional[str] = None      # the client's certificate (PEM)
    key: Optional[str] = None       # its key (None: in the cert file)
    verify: bool = True             # check the server's certificate and name


def parse(url: str, cluster: bool) -> RedisUrl:
    """The URL's parts; a malformed one raises `KvtierError` naming the URL (its password
    replaced by ***)."""
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise fail("url", url, f"is not a URL ({e})") from None
    url = redacted(url)
    if parts.fragment:
        raise fail("url", url, "has a #fragment; a store URL has none")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        if not colon:
            raise fail("url", url, "credentials are written user:password@ or :password@")
        username, password = unquote(user) or None, unquote(secret)
    addrs = [_addr(url, h) for h in hosts.split(",")]
    if not cluster and len(addrs) != 1:
        raise fail("url", url, "names several hosts; a cluster's URL is redis+cluster://host:port,...")
    path = parts.path.strip("/")
    db = 0
    if path:
        if cluster:
            raise fail("url", url, "names a database; a cluster has only database 0")
        if not path.isdigit():
            raise fail("url", url, f"database {path!r} is not a number")
        db = int(path)
    tls = parts.scheme.lower().split("+")[0] in TLS_SCHEMES
    options: dict = {"connections": 4}
    try:
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise fail("url", url, f"has a malformed query {parts.query!r}") from None
    for name, value in query:
        if name in TLS_OPTIONS:
            if not tls:
                raise fail("url", url, f"option {name!r} is a TLS option: the URL's scheme is rediss:// "
                           "(rediss+cluster://, valkeys://)")
            if name in options:
                raise fail("url", url, f"option {name!r} is given twice")
            if name == "verify" and value not in VERIFY:
                raise fail("url", url, f"option verify={value!r} must be one of {list(VERIFY)}")
            if name != "verify" and not value:
                raise fail("url", url, f"option {name}= names no file")
            options[name] = value
            continue
        if name not in OPTIONS:
            known = sorted(OPTIONS) + (sorted(TLS_OPTIONS) if tls else [])
            raise fail("url", url, f"unknown option {name!r}; known: {known}")
        least, most = OPTIONS[name]
        if not value.isdigit() or not least <= int(value) <= most:
            raise fail("url", url, f"option {name}={value!r} must be an integer in [{least}, {most}]")
        options[name] = int(value)
    if "key" in options and "cert" not in options:
        raise fail("url", url, "option key= goes with cert= (the client's certificate)")
    return RedisUrl(addrs, username, password, db, options["connections"], tls, options.get("ca"),
                    options.get("cert"), options.get("key"), options.get("verify", "required") == "required")


def _addr(url: str, text: str) -> Tuple[str, int]:
    if text.startswith("["):                        # [v6]:port
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise fail("url", url, f"bad IPv6 host {text!r}")
        port = rest[1:] if rest else ""
    else:
        host, colon, port = text.partition(":")
        if colon and not port:
            raise fail("url", url, f"host {text!r} has an empty port")
    if not host:
        raise fail("url", url, "names no host")
    if port == "":
        return host, DEFAULT_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise fail("url", url, f"port {port!r} is not a port number (1-65535)")
    return host, int(port)


def redacted(url: str) -> str:
    """The URL with any password replaced (for messages and logs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return parts._replace(netloc=f"{user}:***@{hosts}").geturl()
