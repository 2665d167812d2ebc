"""Every command answers a bad flag or value with exit status 2 and one line on stderr
naming the flag, never a traceback (run as a user would: a fresh `python -m kvtier`)."""
import os
import subprocess
import sys

import pytest

CASES = [
    (["demo", "--pages", "0"], "--pages"),
    (["demo", "--layers", "x"], "--layers"),
    (["demo", "--layout", "sideways"], "--layout"),
    (["demo", "--pages", "4", "--moved-pages", "9"], "--moved-pages"),
    (["codegen", "--target", "sm999"], "--target"),
    (["autotune", "--layers", "0"], "--layers"),
    (["autotune", "--top", "-1"], "--top"),
    (["autotune", "--platform", "tpu"], "--platform"),
    (["autotune", "--ops", ","], "--ops"),
    (["bench", "--ops", "swap"], "--ops"),
    (["nonsense"], "nonsense"),
]


@pytest.mark.parametrize("argv,flag", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_flag_exits_2_with_one_line(argv, flag):
    env = dict(os.environ, KVTIER_PLATFORM="cpu")
    r = subprocess.run([sys.executable, "-m", "kvtier", *argv], capture_output=True, text=True,
                       timeout=120, env=env)
    lines = [l for l in r.stderr.splitlines() if l.strip() and "Warning" not in l and "warn_once" not in l]
    assert r.returncode == 2, (r.returncode, r.stderr[-800:])
    assert "Traceback" not in r.stderr
    assert len(lines) == 1 and flag in lines[0], lines
