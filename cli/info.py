"""`kvtier info`: versions, detected platform and interpreter mode."""
from __future__ import annotations

import os


def register(sub) -> None:
    p = sub.add_parser("info", help="versions, detected platform, interpreter mode")
    p.set_defaults(func=run)


def collect() -> dict:
    import importlib.metadata as md
    import torch
    info = {"kvtier": _version("kvtier"), "torch": torch.__version__}
    try:
        import triton
        info["triton"] = triton.__version__
        info["triton_dist"] = "triton-ascend" if _version("triton-ascend") else "triton"
    except ImportError:
        info["triton"] = None
    info["interpreter"] = os.environ.get("TRITON_INTERPRET", "0") == "1"
    try:
        from kvtier import platforms as platform
        info.update(platform.platform_info())
        from kvtier.pool import link_copy
        info["dma_copies"] = link_copy.describe(info["platform"])
    except ImportError as e:
        info["platform"] = f"unavailable ({e})"
    return info


def _version(dist: str):
    import importlib.metadata as md
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def run(args) -> int:
    for k, v in collect().items():
        print(f"{k:>16}: {v}")
    return 0
