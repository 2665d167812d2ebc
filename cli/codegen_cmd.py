"""`kvtier codegen`: compile the kernels for a GPU target without a GPU and report
access widths, registers and spills per configuration."""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("codegen", help="compile kernels for a target (no GPU needed) and report widths, registers, spills")
    from kvtier.kernels.codegen import TARGETS
    p.add_argument("--target", default="sm90", choices=sorted(TARGETS),
                   help="sm90 (H100/H200), sm80, gfx942 (MI300); default sm90")
    p.add_argument("--json", metavar="FILE", help="also write the reports as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvtier.kernels.codegen import compile_report, default_sweep
    from .args import output_file
    if args.json is not None:
        output_file(args.json, "--json")      # before compiling: a bad path is refused at once
    print(f"kvtier codegen --target {args.target}: widths are bytes per access x number of such "
          "instructions; spills are bytes (CUDA) or registers (AMD)")
    reports, held = [], []
    for config, shape in default_sweep(args.target):
        r = compile_report(args.target, config=config, **shape)
        reports.append(r)
        if r.error and len(held) == len(reports) - 1:
            held.append(r)        # nothing compiled yet: maybe nothing can here (said in one line)
            continue
        for h in held:
            print(h.row())
        held = []
        print(r.row(), flush=True)
    failed = [r for r in reports if r.error]
    if reports and len(failed) == len(reports):
        print(f"kvtier codegen: no configuration compiles for --target {args.target} here "
              f"({len(reports)} tried); the first failed with: {failed[0].error}")
        return 1
    spilled = [r for r in reports if r.spills]
    print(f"{len(reports)} configurations, {len(failed)} failed to compile, {len(spilled)} spill")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in reports], f, indent=1)
    return 1 if failed else 0
