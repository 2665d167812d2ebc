"""The `kvtier` command. Each subcommand lives in its own module with a
``register(subparsers)`` function that adds its parser and sets ``func``; a handler
refuses a bad flag by raising `kvtier.cli.args.UsageError` (one line, exit status 2)."""
from __future__ import annotations

import argparse
import importlib
import sys

# First: torch is imported here without auto-loading device backends, so a broken
# torch_npu (no CANN) cannot take every command down (kvtier.platforms says why).
import kvtier.platforms  # noqa: F401,E402
from kvtier.cli.args import UsageError  # noqa: E402
from kvtier.flags import Parser  # noqa: E402

# name -> module; modules are imported only to build the parser, and each imports
# its heavy dependencies (Triton, torch_npu) inside its handler.
SUBCOMMANDS = {
    "info": "kvtier.cli.info",
    "demo": "kvtier.cli.demo",
    "codegen": "kvtier.cli.codegen_cmd",
    "autotune": "kvtier.cli.autotune_cmd",
    "bench": "kvtier.cli.bench_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvtier", description="KV-cache transfer kernels and tools")
    sub = p.add_subparsers(dest="command", required=True)
    for name, mod in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod:
                continue  # subcommand not part of this build
            raise
        module.register(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
