"""The store's own throughput: ``redis-benchmark`` (or ``valkey-benchmark``) GET and SET
of one value size against a node or a cluster, parsed from its CSV output. This is the
raw figure `kvtier bench --store` puts beside kvtier's own."""
from __future__ import annotations

import csv
import io
import shutil
import subprocess
from typing import Dict, Optional, Sequence

from kvtier.errors import fail

CLIENTS = 50        # redis-benchmark's default: 50 connections, one request in flight each
MIN_BYTES = 256 << 20   # moved at least (each way): fewer requests over 50 connections
                        # measure mostly their setup


def run(host: str, port: int, value_bytes: int, count: int, *, cluster: bool = False,
        username: Optional[str] = None, password: Optional[str] = None, db: int = 0,
        tls_args: Sequence[str] = (), timeout_s: float = 600.0) -> Dict[str, object]:
    """``{"get_gbps", "set_gbps", "set_one_key_gbps", "get_rps", "set_rps", "requests",
    "written", "how"}`` for values of ``value_bytes`` (at least 256 MiB of requests, and at
    least ``count``): GETs of one key, and SETs of new keys (``-r``: keys drawn from as
    many names as requests, so most SETs make a key, as a store tier's backups do; SETs
    that overwrite one key cost the server about half as much, kept as
    ``set_one_key_gbps``). ``written``: the key names the SETs may have made (the
    caller removes them; in a cluster redis-benchmark adds a hash tag per master after
    ``key:``, which the cluster engine finds); ``how``: the commands, the password
    replaced. ``tls_args``: its TLS options (``--tls --cacert ...``), for a TLS server."""
    for arg, v in (("value_bytes", value_bytes), ("count", count)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise fail(arg, v, "must be a positive int")
    exe = shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")
    if exe is None:
        raise fail("redis-benchmark", None, "is not on PATH: the raw Redis figures need it "
                   "(Debian: apt-get install redis-tools, or redis-server which brings it)")
    requests = max(count, -(-MIN_BYTES // value_bytes))
    base = [exe, "-h", host, "-p", str(port), "-c", str(CLIENTS), "-d", str(value_bytes), "-n", str(requests),
            "--csv"]
    if cluster:
        base.append("--cluster")
    if db:
        base += ["--dbnum", str(db)]
    if username:
        base += ["--user", username]
    base += list(tls_args)
    one_key = _rps(base + ["-t", "set,get"], password, timeout_s)
    new_keys = _rps(base + ["-t", "set", "-r", str(requests)], password, timeout_s)
    get_rps, set_rps = one_key["GET"], new_keys["SET"]
    return {"get_gbps": get_rps * value_bytes / 1e9, "set_gbps": set_rps * value_bytes / 1e9,
            "set_one_key_gbps": one_key["SET"] * value_bytes / 1e9,
            "get_rps": get_rps, "set_rps": set_rps, "requests": requests,
            "written": ["key:__rand_int__"] + [f"key:{i:012d}" for i in range(requests)],
            "how": f"{one_key['how']}; {new_keys['how']}"}


def _rps(cmd: list, password: Optional[str], timeout_s: float) -> Dict[str, object]:
    """Requests per second per test of one redis-benchmark run, and ``how`` it ran."""
    shown = list(cmd)
    if password is not None:
        cmd = cmd + ["-a", password]
        shown += ["-a", "***"]
    how = " ".join(shown)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{how}: no result in {timeout_s:.0f} s") from None
    table = done.stdout[done.stdout.find('"test"'):]        # --cluster prints the masters first
    rows = {row.get("test"): row.get("rps") for row in csv.DictReader(io.StringIO(table))}
    tests = cmd[cmd.index("-t") + 1].upper().split(",")
    try:
        out: Dict[str, object] = {t: float(rows[t]) for t in tests}
    except (KeyError, TypeError, ValueError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{how} exited {done.returncode} without {' and '.join(tests)} figures: "
                           + " | ".join(tail)) from None
    out["how"] = how
    return out
