"""Shared test tools: random bytes, poisoned destinations and sentinel margins.

The interpreter does not catch out-of-bounds accesses, so every buffer a kernel touches
is carved out of a larger allocation whose margins hold random sentinel bytes;
`Guarded.check()` proves the margins are intact.
"""
from __future__ import annotations

import torch

MARGIN = 256          # bytes of sentinel on each side of a buffer
POISON = 0xA5         # byte pattern written into destinations before a copy


def random_bytes(n: int, gen: torch.Generator | None = None, device="cpu") -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(device)


class Guarded:
    """A tensor of ``shape``/``dtype`` living between two random sentinel margins."""

    def __init__(self, shape, dtype, device="cpu", fill="random", gen=None, pin=False):
        shape = tuple(shape)
        item = torch.empty(0, dtype=dtype).element_size()
        n = item
        for s in shape:
            n *= s
        self.nbytes = n
        raw = random_bytes(2 * MARGIN + n, gen)
        if pin:
            raw = raw.pin_memory()
        self.raw = raw.to(device)
        self.front = self.raw[:MARGIN].clone()
        self.back = self.raw[MARGIN + n:].clone()
        body = self.raw[MARGIN:MARGIN + n]
        if fill == "poison":
            body.fill_(POISON)
        elif fill == "zeros":
            body.zero_()
        self.t = body.view(dtype).view(shape)

    def bytes(self) -> torch.Tensor:
        return self.raw[MARGIN:MARGIN + self.nbytes]

    def snapshot(self) -> torch.Tensor:
        return self.bytes().clone()

    def check(self) -> None:
        assert torch.equal(self.raw[:MARGIN], self.front), "front sentinel margin overwritten"
        assert torch.equal(self.raw[MARGIN + self.nbytes:], self.back), "back sentinel margin overwritten"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (any dtype) as a uint8 tensor with a trailing byte dim."""
    return t.contiguous().view(torch.uint8)


def assert_bytes_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    g, w = as_bytes(got), as_bytes(want)
    if not torch.equal(g, w):
        diff = (g != w).nonzero()
        raise AssertionError(f"{what}: {diff.shape[0]} bytes differ, first at {diff[0].tolist()}")
