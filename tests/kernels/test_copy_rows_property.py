"""Property-based copy_rows tests (hypothesis): random forms, shapes, page sizes, dtypes,
indices, layer ranges and launch configurations, each checked bit for bit against the
torch oracle over the original tensors (see copy_rows_support.py), with poisoned,
guarded destinations.

The interpreter is slow, so examples are few and small; the derandomized database-free
settings keep CI runs reproducible.
"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from copy_rows_support import FORMS, Side, run_and_check
from copy_rows_support import kernel_really_runs  # noqa: F401  (autouse fixture: the kernel runs)
from kvtier.kernels import CopyConfig, copy_rows_reference

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
PROFILE = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.function_scoped_fixture])


@st.composite
def copies(draw):
    """A copy: two sides, indices, a layer range and a config."""
    src_form, dst_form = draw(st.sampled_from(FORMS)), draw(st.sampled_from(FORMS))
    dtype = draw(st.sampled_from(DTYPES))
    item = torch.empty(0, dtype=dtype).element_size()
    H = draw(st.integers(1, 3))
    D = draw(st.integers(1, 40 // item))
    C = draw(st.integers(1, 2))
    sides = []
    for form, fill in ((src_form, "random"), (dst_form, "poison")):
        P = draw(st.sampled_from((1, 2, 4)))
        N = P * draw(st.integers(1, 12 // P + 1))
        L = draw(st.integers(1, 3))
        sides.append(dict(form=form, P=P, N=N, L=L, fill=fill))
    s, d = sides
    k = draw(st.integers(0, min(s["N"], d["N"])))
    si = draw(st.lists(st.integers(0, s["N"] - 1), min_size=k, max_size=k))          # repeats allowed
    di = draw(st.lists(st.integers(0, d["N"] - 1), min_size=k, max_size=k, unique=True))
    src_layer = draw(st.integers(0, s["L"] - 1))
    dst_layer = draw(st.integers(0, d["L"] - 1))
    most = min(s["L"] - src_layer, d["L"] - dst_layer)
    num_layers = draw(st.one_of(st.none(), st.integers(0, most)))
    config = CopyConfig(num_programs=draw(st.sampled_from((1, 2, 5))),
                        rows=draw(st.sampled_from((1, 2, 4, 64))),
                        block_bytes=draw(st.sampled_from((2, 8, 32, 4096))))
    idx_dtype = draw(st.sampled_from((torch.int32, torch.int64)))
    seed = draw(st.integers(0, 2**16))
    return dict(sides=sides, C=C, row=(H, D), dtype=dtype, si=torch.tensor(si, dtype=idx_dtype),
                di=torch.tensor(di, dtype=idx_dtype), src_layer=src_layer, dst_layer=dst_layer,
                num_layers=num_layers, config=config, seed=seed)


def _build(case):
    s, d = case["sides"]
    mk = lambda side, seed: Side(side["form"], C=case["C"], L=side["L"], N=side["N"], P=side["P"],
                                 row=case["row"], dtype=case["dtype"], fill=side["fill"], seed=seed)
    return mk(s, case["seed"]), mk(d, case["seed"] + 1)


@PROFILE
@given(copies())
def test_copy_rows_matches_torch(case):
    src, dst = _build(case)
    run_and_check(src, case["si"], dst, case["di"], src_layer=case["src_layer"],
                  dst_layer=case["dst_layer"], num_layers=case["num_layers"], config=case["config"])


@settings(PROFILE, max_examples=40)
@given(copies())
def test_reference_matches_torch(case):
    """The fallback and oracle-of-record obeys the same semantics."""
    src, dst = _build(case)
    run_and_check(src, case["si"], dst, case["di"], fn=copy_rows_reference, src_layer=case["src_layer"],
                  dst_layer=case["dst_layer"], num_layers=case["num_layers"])


@st.composite
def page_copies(draw):
    """Whole-page copies between two forms with equal page size."""
    src_form, dst_form = draw(st.sampled_from(FORMS)), draw(st.sampled_from(FORMS))
    P = draw(st.sampled_from((2, 4, 8)))
    pages_s, pages_d = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    k = draw(st.integers(0, min(pages_s, pages_d)))
    sp = draw(st.lists(st.integers(0, pages_s - 1), min_size=k, max_size=k))
    dp = draw(st.lists(st.integers(0, pages_d - 1), min_size=k, max_size=k, unique=True))
    idx_dtype = draw(st.sampled_from((torch.int32, torch.int64)))
    expand = lambda pages: (torch.tensor(pages, dtype=torch.int64)[:, None] * P + torch.arange(P)).flatten().to(idx_dtype)
    return dict(src_form=src_form, dst_form=dst_form, P=P, N=(pages_s * P, pages_d * P),
                si=expand(sp), di=expand(dp), H=draw(st.integers(1, 2)), D=draw(st.integers(1, 6)),
                seed=draw(st.integers(0, 2**16)))


@settings(PROFILE, max_examples=80)
@given(page_copies())
def test_by_page_matches_torch(case):
    src = Side(case["src_form"], C=2, L=2, N=case["N"][0], P=case["P"], row=(case["H"], case["D"]),
               dtype=torch.bfloat16, seed=case["seed"])
    dst = Side(case["dst_form"], C=2, L=2, N=case["N"][1], P=case["P"], row=(case["H"], case["D"]),
               dtype=torch.bfloat16, fill="poison", seed=case["seed"] + 1)
    run_and_check(src, case["si"], dst, case["di"], by_page=True)
