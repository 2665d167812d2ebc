"""The TLS context of a ``rediss://`` (``rediss+cluster://``) engine, built once at its
construction from the URL's options (`kvtier.store.redis_url`) and used for every
connection the engine opens, to seeds and to the nodes a cluster names alike.

- ``verify=required`` (the default): the server's certificate must chain to a CA of
  ``ca`` (a PEM file; without it, the system's trusted CAs) and name the host the URL
  (or the cluster's slot map, or a redirect) gives: a DNS name against the certificate's
  DNS names, an IP address (``127.0.0.1``) against its IP addresses.
- ``verify=none``: the server's certificate is not checked (encryption without knowing
  who is at the other end); ``ca`` is then not read.
- ``cert`` (and ``key``, where the key is not in the same file): the client's
  certificate, for a server that asks for one (``tls-auth-clients``).

A file that cannot be read or holds no usable certificate or key raises `KvtierError`
naming the URL, the option and its value, before any connection."""
from __future__ import annotations

import ssl
from typing import List

from kvtier.errors import fail

from .redis_url import RedisUrl


def context(conf: RedisUrl, url: str) -> ssl.SSLContext:
    """A client context for ``conf`` (a TLS URL; ``url``, redacted, names it in errors)."""
    for option in ("ca", "cert", "key"):         # each file there and readable, whatever verify says
        path = getattr(conf, option)
        if path is not None:
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise fail("url", url, f"option {option}={path!r}: cannot be read ({e.strerror or e})") from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)      # TLS 1.2 and later; hostname check and CERT_REQUIRED
    if conf.verify:
        if conf.ca is not None:
            _load(url, f"option ca={conf.ca!r}: not a PEM file of CA certificates",
                  lambda: ctx.load_verify_locations(cafile=conf.ca))
        else:
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    else:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if conf.cert is not None:
        def no_passphrase():
            raise fail("url", url, f"option key={conf.key or conf.cert!r}: the key is encrypted; "
                       "kvtier reads an unencrypted key")
        if conf.key is None:
            what = f"option cert={conf.cert!r}: not a PEM certificate with its key (a key in another file: key=)"
        else:
            what = f"options cert={conf.cert!r}, key={conf.key!r}: not a PEM certificate and its key"
        _load(url, what, lambda: ctx.load_cert_chain(conf.cert, conf.key, password=no_passphrase))
    return ctx


def benchmark_args(conf: RedisUrl) -> List[str]:
    """``redis-benchmark``'s options for the same TLS (it checks the chain, not the name)."""
    args = ["--tls"]
    if not conf.verify:
        args.append("--insecure")
    elif conf.ca is not None:
        args += ["--cacert", conf.ca]
    if conf.cert is not None:
        args += ["--cert", conf.cert, "--key", conf.key or conf.cert]
    return args


def _load(url: str, what: str, load) -> None:
    try:
        load()
    except ssl.SSLError as e:           # read, but not a certificate or key OpenSSL takes
        raise fail("url", url, f"{what} ({_reason(e)})") from None
    except OSError as e:                # gone since it was opened
        raise fail("url", url, f"{what} ({e.strerror or e})") from None


def _reason(e: ssl.SSLError) -> str:
    """An ssl error's words without OpenSSL's source location."""
    text = e.args[1] if len(e.args) > 1 and isinstance(e.args[1], str) else str(e)
    return text.split(" (_ssl.c:")[0]
