"""The index-check kernel compiles for sm_90 in every form the launcher uses (one or two
lists, with and without whole-page checks, negatives refused or skipped, with no, one or
two engine tables). Compiled in a
process of its own: the kernel uses Triton's reductions, whose helpers are interpreted
functions where TRITON_INTERPRET=1 (as in this test run)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton.backends.nvidia", reason="needs community Triton's CUDA backend")

SCRIPT = textwrap.dedent("""
    import itertools, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kvtier.kernels.index_check_kernel import check_indices_jit as k
    runtime = {"a_idx": "*i64", "a_n": "i32", "a_stride": "i32", "a_limit": "i64", "a_id": "i32",
               "b_idx": "*i32", "b_n": "i32", "b_stride": "i32", "b_limit": "i64", "b_id": "i32",
               "ta": "*i64", "ta_n": "i32", "ta_id": "i32", "tb": "*u64", "tb_n": "i32", "tb_id": "i32",
               "verdict": "*i32", "record": "*i64"}
    for two, page, neg, tables in itertools.product((False, True), (1, 16), (False, True), (0, 2)):
        const = {"A_PAGE": page, "B_PAGE": page, "TWO": two, "NEG_SKIPS": neg, "TABLES": tables,
                 "T_ALIGN": 16, "BLOCK": 1024}
        sig = dict(runtime, **{name: "constexpr" for name in const})
        c = triton.compile(ASTSource(fn=k, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32))
        assert ".entry" in c.asm["ptx"]
    print("compiled 16 forms")
""")


def test_index_check_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "compiled 16 forms" in r.stdout, r.stderr[-2000:]
