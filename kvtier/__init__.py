"""kvtier: KV-cache transfers (backup, load, index-gather) for LLM serving engines, one
Triton code base for CUDA, ROCm and Ascend.

Subpackages: `kvtier.kernels` (row maps and the row-copy kernel), `kvtier.pool` (device
and host pools), `kvtier.autotune` (per-device launch configurations),
`kvtier.platforms` (what differs per accelerator), `kvtier.adapters` (engines' own call
signatures), `kvtier.cli` (the `kvtier` command, also `python -m kvtier`).

Importing this package imports nothing else: neither torch nor Triton.
"""
__version__ = "0.2.0"
