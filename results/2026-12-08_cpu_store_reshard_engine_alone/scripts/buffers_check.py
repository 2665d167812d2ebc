"""`Engine._buffers` per key, the module given (an engine.py of another commit, e.g.
`git show 032143d:store/engine.py > /tmp/engine_old.py`) against the installed one:

    python buffers_check.py /tmp/engine_old.py
"""
import timeit, sys, importlib.util

from kvtier.store import engine as new
spec = importlib.util.spec_from_file_location("kvtier.store.engine_old", sys.argv[1])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
import torch
page = memoryview(bytearray(256 << 10))
hdr_b = bytearray(344)
hdr_v = memoryview(bytearray(344))
whole = memoryview(bytearray(300 << 10))
cases = {"direct, bytearray header (old tier)": [[hdr_b, page]], "direct, view header (new tier)": [[hdr_v, page]],
         "staged whole (1-tuple)": [(whole,)]}
for name, seqs in cases.items():
    for mod in (old, new):
        t = min(timeit.repeat(lambda: mod._buffers("targets", seqs, 1, True), number=20000, repeat=5)) / 20000
        print(f"{name:40} {mod.__name__:28} {t*1e6:.2f} us")
