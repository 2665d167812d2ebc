"""The transfer vocabulary: every operation kvtier runs, named once.

An operation is a direction of the row copy:

- ``backup``: device rows -> host rows (crosses the device-host link)
- ``load``: host rows -> device rows (crosses the link)
- ``gather``: scattered device rows -> one contiguous device buffer
- ``scatter``: the reverse of gather

Its scope is ``all`` (every layer of the maps) or ``layer`` (one layer: HiCache's per-layer
load while the forward pass runs). A transfer's name joins the two: ``backup``, ``load``,
``load_layer``, ``gather``, ``scatter``. Autotune keys, the launch log, the benchmark and
both `kvtier autotune --ops` and `kvtier bench --ops` use these names and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.errors import fail

OPS = ("backup", "load", "gather", "scatter")
SCOPES = ("all", "layer")
_CROSSES_LINK = {"backup": True, "load": True, "gather": False, "scatter": False}


@dataclass(frozen=True)
class Op:
    """One operation at one scope; ``Op.parse("load_layer") == Op("load", "layer")``."""

    name: str
    scope: str = "all"
    # Whether the source side is the device pool (backup, gather): worked out once, as
    # every pool call reads it.
    from_device: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.name not in OPS:
            raise fail("op", self.name, f"must be one of {OPS}")
        if self.scope not in SCOPES:
            raise fail("scope", self.scope, f"must be one of {SCOPES}")
        object.__setattr__(self, "from_device", self.name in ("backup", "gather"))

    @property
    def label(self) -> str:
        """The transfer's name: the op for all layers, ``<op>_layer`` for one layer."""
        return self.name if self.scope == "all" else f"{self.name}_{self.scope}"

    @property
    def crosses_link(self) -> bool:
        return _CROSSES_LINK[self.name]

    def __str__(self) -> str:
        return self.label

    @classmethod
    def parse(cls, label, arg: str = "op") -> "Op":
        """The Op a transfer name stands for; an Op passes through."""
        if isinstance(label, Op):
            return label
        if label in LABELS:
            name, _, scope = str(label).partition("_")
            return cls(name, scope or "all")
        raise fail(arg, label, f"must be one of {LABELS}")


BACKUP, LOAD, LOAD_LAYER = Op("backup"), Op("load"), Op("load", "layer")
GATHER, SCATTER = Op("gather"), Op("scatter")
# Transfer names the tools accept: the pools' operations (a per-layer backup or gather is
# not something an engine issues).
LABELS = ("backup", "load", "load_layer", "gather", "scatter")


def parse_list(text: str, arg: str = "--ops") -> tuple:
    """A comma-separated list of transfer names, each checked; empty items are refused."""
    items = [s.strip() for s in str(text).split(",")]
    if not items or any(not s for s in items):
        raise fail(arg, text, f"must be a comma-separated list of {LABELS}")
    return tuple(Op.parse(s, arg) for s in items)
