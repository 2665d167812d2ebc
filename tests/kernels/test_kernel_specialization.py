"""What Triton specializes the kernels on at launch: the counts, limits, argument ids,
buffer addresses, component strides and start layers that change from call to call give
one compiled variant whatever their value (1, a multiple of 16 or neither), while the
arguments a variant depends on (table or not, the tables' and lists' alignment) still
tell variants apart. Read through Triton's own launch binder
for the CUDA backend, which needs no GPU."""
import itertools

import pytest
import torch

pytest.importorskip("triton.backends.nvidia", reason="needs community Triton's CUDA backend")
jit = pytest.importorskip("triton.runtime.jit")
if not hasattr(jit, "create_function_from_signature"):
    pytest.skip("this Triton builds its launch binder otherwise", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402

from kvtier.kernels.codegen import compilable  # noqa: E402
from kvtier.kernels.copy_rows_kernel import copy_rows_jit  # noqa: E402
from kvtier.kernels.index_check_kernel import check_indices_jit  # noqa: E402


def binder(kernel):
    fn = compilable(kernel)
    return jit.create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))


def copy_args(**over):
    table = torch.zeros(16, dtype=torch.int64)
    idx = torch.arange(32)
    args = {n: 4096 for n in copy_rows_jit.arg_names}
    args.update(src_table=table, src_table2=table, src_idx=idx, dst_table=table, dst_table2=table, dst_idx=idx,
                verdict=torch.zeros(8, dtype=torch.int64), record=torch.zeros(8, dtype=torch.int64),
                SRC_TABLE=True, DST_TABLE=False, CHECK=2)
    args.update(over)
    return [args[n] for n in copy_rows_jit.arg_names]


def test_what_changes_per_call_compiles_one_variant():
    bind = binder(copy_rows_jit)
    keys = {str(bind(*copy_args(n_idx=n, src_layer0=s, dst_layer0=d, src_limit=n + s, dst_base=b, src_base=b,
                                src_comp_stride=b, src_arg=s, dst_targ=d), num_warps=4)[1])
            for n, s, d, b in itertools.product((1, 16, 17), (0, 1, 5), (0, 1, 32), (1, 4096, 4104))}
    assert len(keys) == 1


def test_what_a_variant_depends_on_still_tells_them_apart():
    bind = binder(copy_rows_jit)
    base = str(bind(*copy_args(), num_warps=4)[1])
    odd = torch.zeros(65, dtype=torch.int64)[1:]           # an 8-byte, not 16-byte, aligned table
    assert str(bind(*copy_args(SRC_TABLE=False), num_warps=4)[1]) != base
    assert str(bind(*copy_args(src_table=odd), num_warps=4)[1]) != base
    assert str(bind(*copy_args(src_idx=torch.arange(33)[1:]), num_warps=4)[1]) != base
    assert str(bind(*copy_args(n_layers=1), num_warps=4)[1]) != base      # still specialized


def test_check_counts_and_argument_ids_compile_one_variant():
    bind = binder(check_indices_jit)
    idx, words, record = torch.arange(32), torch.zeros(2, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)
    table = torch.zeros(8, dtype=torch.int64)
    keys = {str(bind(idx, n, 1, n + 4096, ia, idx, n, 1, 4096 + ib, ib, table, n, ia, table, n, ib, words, record,
                     16, 16, True, False, 2, 16, 1024, num_warps=4)[1])
            for n, ia, ib in itertools.product((1, 16, 33), (0, 1), (1, 2))}
    assert len(keys) == 1
