"""Property tests (hypothesis) of copy_rows with random valid and invalid arguments.

Each example draws a valid copy (the `copies` strategy of test_copy_rows_property: random
forms, shapes, dtypes, indices, layer range and configuration) and, for each kind of
break, breaks one argument: wrong types, dtypes, shapes and devices of the indices,
out-of-range or negative index values, index lists of different lengths, bad layer
starts and counts, maps that cannot be paired, configurations that are no CopyConfig.
``by_page=True`` on the drawn indices is valid or not by chance (whole pages or not).

- A valid call matches the torch oracle bit for bit (poisoned destination, margins).
- An invalid call raises `KvtierError` whose message names the argument (and its value
  where the call has one to name), and leaves every byte of every buffer, margins
  included, as it was; the valid call afterwards still matches the oracle, so a failure
  recorded by a device-side index check does not leak into the next call.

Inputs that once failed (a start layer that is no number, sparse indices, bad CopyConfig
fields) keep a test of their own at the end.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from copy_rows_support import Side, copy_rows, run_and_check
from copy_rows_support import kernel_really_runs  # noqa: F401  (autouse fixture: the kernel runs)
from kvtier.kernels import CopyConfig, KvtierError
from test_copy_rows_property import PROFILE, _build, copies

ARGS = ("src_indices", "dst_indices")


class Call:
    """One copy_rows call: its arguments, every Side whose bytes it may touch, and what it
    should do: ``expect`` is None for a valid call, else the message fragments one of
    which the error must contain (argument name, with the value where it is known)."""

    def __init__(self, case):
        self.case = case
        self.src, self.dst = _build(case)
        self.sides = [self.src, self.dst]
        self.si, self.di = case["si"], case["di"]
        self.kw = dict(src_layer=case["src_layer"], dst_layer=case["dst_layer"],
                       num_layers=case["num_layers"], config=case["config"])
        self.maps = dict(src=self.src.map, dst=self.dst.map)
        self.expect = None
        self.what = "valid"

    def __repr__(self):
        return (f"Call({self.what}: {self.src.form} -> {self.dst.form}, si={self.si!r}, di={self.di!r}, "
                f"{self.kw}, expect={self.expect})")

    def run(self):
        copy_rows(self.maps["src"], self.si, self.maps["dst"], self.di, **self.kw)


# ------------------------------------------------------------------ ways to break one argument
def _index_list(call, arg):
    return call.si if arg == "src_indices" else call.di


def _set_index_list(call, arg, value):
    if arg == "src_indices":
        call.si = value
    else:
        call.di = value


def break_index_form(draw, call):
    """Not a 1-D int32/int64 tensor on the copy's device."""
    arg = draw(st.sampled_from(ARGS))
    idx = _index_list(call, arg)
    how = draw(st.sampled_from(["list", "numpy", "none", "int", "float32", "float64", "int16",
                                "uint8", "bool", "2-D", "0-D", "meta"]))
    value, fragment = {
        "list": (idx.tolist(), f"{arg}='list'"),
        "numpy": (idx.numpy(), f"{arg}='ndarray'"),
        "none": (None, f"{arg}='NoneType'"),
        "int": (3, f"{arg}='int'"),
        "float32": (idx.float(), f"{arg}.dtype=torch.float32"),
        "float64": (idx.double(), f"{arg}.dtype=torch.float64"),
        "int16": (idx.to(torch.int16), f"{arg}.dtype=torch.int16"),
        "uint8": (idx.to(torch.uint8), f"{arg}.dtype=torch.uint8"),
        "bool": (idx.bool(), f"{arg}.dtype=torch.bool"),
        "2-D": (idx.view(1, -1), f"{arg}.shape=(1, {idx.numel()})"),
        "0-D": (torch.tensor(0, dtype=idx.dtype), f"{arg}.shape=()"),
        "meta": (idx.to("meta"), f"{arg}.device='meta'"),
    }[how]
    _set_index_list(call, arg, value)
    call.expect = [fragment]
    call.what = f"{arg}: {how}"


def break_index_value(draw, call):
    """One index out of range or negative (the copy's own rows are the limit)."""
    arg = draw(st.sampled_from(ARGS))
    idx = _index_list(call, arg)
    if idx.numel() == 0:
        return break_count(draw, call)
    rows = (call.src if arg == "src_indices" else call.dst).N
    bad = draw(st.sampled_from([rows, rows + 1, rows + 1000, 2**31 - 1, -1, -rows, -(2**31)]))
    if idx.dtype == torch.int64 and draw(st.booleans()):
        bad = draw(st.sampled_from([2**40, -(2**40)]))
    if call.kw["num_layers"] == 0:
        call.kw["num_layers"] = None    # a call that moves no layer checks no index value
    pos = draw(st.integers(0, idx.numel() - 1))
    idx = idx.clone()
    idx[pos] = bad
    _set_index_list(call, arg, idx)
    call.expect = [f"{arg}={bad}"]
    call.what = f"{arg}[{pos}] = {bad}"


def break_count(draw, call):
    """Index lists of different lengths."""
    di = call.di
    call.di = di[:-1] if di.numel() and draw(st.booleans()) else torch.cat([di, di[:1] if di.numel() else
                                                                            torch.zeros(1, dtype=di.dtype)])
    call.expect = [f"dst_indices='{call.di.numel()} indices': src_indices has {call.si.numel()}"]
    call.what = "counts differ"


def break_layers(draw, call):
    """A start layer or a count that is no layer (bool, float, negative, past the end)."""
    src_l, dst_l = call.src.L, call.dst.L
    arg = draw(st.sampled_from(["src_layer", "dst_layer", "num_layers"]))
    if arg == "num_layers":
        value = draw(st.sampled_from([-1, -100, True, False, 1.0, 0.5, "1", [1]]
                                     + [src_l + 1, dst_l + 1, 10**6]))
    else:
        layers = src_l if arg == "src_layer" else dst_l
        value = draw(st.sampled_from([-1, -(10**6), layers, layers + 3, True, False, 0.0, 1.5]))
    call.kw[arg] = value
    kw = call.kw
    if arg == "num_layers" and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        # A count past the end is named by the first start layer it runs out from.
        if kw["src_layer"] + value > src_l:
            call.expect = [f"src_layer={kw['src_layer']!r}"]
        elif kw["dst_layer"] + value > dst_l:
            call.expect = [f"dst_layer={kw['dst_layer']!r}"]
        else:
            call.expect = None      # not past the end after all: a valid call
    else:
        call.expect = [f"{arg}={value!r}"]
    call.what = f"{arg}={value!r}"


def break_map(draw, call):
    """A map argument that is no RowMap, or maps that cannot be paired."""
    how = draw(st.sampled_from(["src-not-map", "dst-not-map", "row_bytes", "components"]))
    if how.endswith("not-map"):
        arg = how[:3]
        value = draw(st.sampled_from([None, torch.zeros(4), call.src.guards[0].t, "map"]))
        call.maps[arg] = value
        call.expect = [f"{arg}={type(value).__name__!r}: must be a kvtier RowMap"]
    else:
        d, (H, D) = call.dst, call.case["row"]
        other = Side(d.form, C=d.C + (how == "components"), L=d.L, N=d.N, P=d.P,
                     row=(H + (how == "row_bytes"), D), dtype=call.case["dtype"], fill="poison", seed=7)
        call.sides.append(other)
        call.maps["dst"] = other.map
        call.expect = [f"dst.row_bytes={other.row_bytes}" if how == "row_bytes" else
                       f"dst.num_components={other.C}"]
    call.what = how


def break_config(draw, call):
    """A configuration that is no CopyConfig."""
    value = draw(st.sampled_from([{"num_programs": 2}, "fast", 4, [CopyConfig()], CopyConfig().to_dict()]))
    call.kw["config"] = value
    call.expect = [f"config={type(value).__name__!r}: must be a kvtier CopyConfig"]
    call.what = f"config={value!r}"


def by_page(draw, call):
    """by_page=True on the drawn indices: valid where both lists happen to be whole pages
    of equal page sizes, else refused naming the flag or a list that is not whole pages."""
    call.kw["by_page"] = True
    call.what = "by_page"
    s, d = call.src, call.dst
    if s.P != d.P:
        call.expect = [f"by_page=True: page sizes differ (src {s.P}, dst {d.P})"]
        return
    bad = [arg for arg, idx in zip(ARGS, (call.si, call.di)) if not _whole_pages(idx, s.P)]
    call.expect = [f for arg in bad for f in (f"{arg}=", f"len({arg})=")] or None


def _whole_pages(idx: torch.Tensor, page: int) -> bool:
    if idx.numel() % page:
        return False
    runs = idx.long().view(-1, page)
    return bool(((runs[:, :1] % page == 0) & (runs - runs[:, :1] == torch.arange(page))).all())


BREAKS = [break_index_form, break_index_value, break_count, break_layers, break_map, break_config, by_page]


@st.composite
def calls(draw, brk):
    """A drawn valid copy, broken by ``brk`` (None: left valid)."""
    call = Call(draw(copies()))
    if brk is not None:
        brk(draw, call)
    return call


def _bytes(call):
    return [b for side in call.sides for b in side.raw()]


# Every kind of break gets its own examples (one mixed draw leaves some kinds out).
@pytest.mark.parametrize("brk", [None] + BREAKS, ids=["valid"] + [b.__name__ for b in BREAKS])
@settings(PROFILE, max_examples=12)
@given(data=st.data())
def test_random_valid_and_invalid_calls(brk, data):
    call = data.draw(calls(brk))
    case = call.case
    event("valid" if call.expect is None else "refused")
    if call.expect is None:
        kw = {k: v for k, v in call.kw.items() if k != "config" or v is not None}
        run_and_check(call.src, call.si, call.dst, call.di, **kw)
        return
    before = _bytes(call)
    with pytest.raises(KvtierError) as err:
        call.run()
    msg = str(err.value)
    assert any(f in msg for f in call.expect), f"{call.what}: {msg!r} names none of {call.expect}"
    after = _bytes(call)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{call.what}: bytes moved before the error"
    for side in call.sides:
        side.check_margins()
    # The unbroken call on the same buffers: no failure left behind by the refused one.
    run_and_check(call.src, case["si"], call.dst, case["di"], src_layer=case["src_layer"],
                  dst_layer=case["dst_layer"], num_layers=case["num_layers"], config=case["config"])


# ------------------------------------------------------------------ known failures
@pytest.fixture
def pair():
    src = Side("table", L=2, N=8, P=2, row=(1, 4), seed=1)
    dst = Side("stacked", L=2, N=8, P=2, row=(1, 4), fill="poison", seed=2)
    return src, dst


GOOD = torch.tensor([0, 1])


@pytest.mark.parametrize("arg", ["src_layer", "dst_layer"])
@pytest.mark.parametrize("value", [None, "1", [0]])
def test_start_layer_that_is_no_number_with_a_count(pair, arg, value):
    src, dst = pair
    with pytest.raises(KvtierError, match=f"{arg}="):
        copy_rows(src.map, GOOD, dst.map, GOOD, num_layers=1, **{arg: value})


@pytest.mark.parametrize("arg", ARGS)
def test_sparse_indices(pair, arg):
    src, dst = pair
    idx = {a: GOOD for a in ARGS}
    idx[arg] = GOOD.to_sparse()
    with pytest.raises(KvtierError, match=arg):
        copy_rows(src.map, idx["src_indices"], dst.map, idx["dst_indices"])


@pytest.mark.parametrize("field,value", [("num_programs", 0), ("rows", 3), ("block_bytes", -8),
                                         ("num_warps", 1.0), ("strategy", "warp")])
def test_bad_config_fields(field, value):
    with pytest.raises(KvtierError, match=f"CopyConfig.{field}="):
        CopyConfig(**{field: value})

