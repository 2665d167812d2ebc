"""`kvtier info`: versions, detected platform and interpreter mode."""
from __future__ import annotations

import os


def register(sub) -> None:
    p = sub.add_parser("info", help="versions, detected platform, interpreter mode")
    p.add_argument("--json", action="store_true", help="print the same facts as one JSON object")
    p.set_defaults(func=run)


def collect() -> dict:
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
    from .args import check_environment
    check_environment()
    info = collect()
    if getattr(args, "json", False):
        import json
        print(json.dumps(info, indent=1, default=str))
    else:
        print(format_info(info))
    return 0


def format_info(info: dict) -> str:
    """Aligned ``key: value`` lines; nested facts (the device, launch limits) one per line."""
    rows = []
    for k, v in info.items():
        if isinstance(v, dict):
            rows.extend((f"{k}.{kk}", vv) for kk, vv in v.items())
        else:
            rows.append((k, v))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:>{width}}: {v}" for k, v in rows)
