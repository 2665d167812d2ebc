"""`kvtier bench`: GB/s of kvtier's transfers (kernel-only device time, host time per
call beside it) against the same-run link ceiling and the baselines (plain torch, a
same-size copy_; sgl_kernel and vLLM's swap kernel where they can run), the host time per
call of the pools' and adapters' hot-path calls beside torch's index ops, and a table,
JSON and PNG of it all. `--interference` runs only a transfer's GB/s beside a concurrent
GEMM's slowdown (CUDA; `--smoke` gives its structure on the CPU). `--store URL` runs
only the store tier's prefetch and backup beside the store's own raw figures (throughput,
a TP 8 -> TP 2 reshard read, then one- and four-page latency; `--latency`: the latency
alone; `--reshard`: the reshard alone).

On a machine without an accelerator it runs a small smoke sweep under Triton's
interpreter and says that its figures are not hardware figures. `--overhead` runs only
the host-time measurement (no sweep); `--json FILE` writes it."""
from __future__ import annotations

import datetime
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from .args import UsageError, as_usage, check_environment, check_fits, int_list, name_list, output_dir, output_file

# Sweep dimensions: flag, Grid field. --ops takes the transfer names of
# kvtier.kernels.ops (as `kvtier autotune --ops`), --layouts and --strategies their names,
# the rest ints >= 1.
DIMENSIONS = (
    ("--ops", "ops"), ("--layouts", "layouts"), ("--rows", "row_bytes"), ("--pages", "page_sizes"),
    ("--tokens", "tokens"), ("--strategies", "strategies"), ("--caps", "program_caps"),
)


def register(sub) -> None:
    from kvtier.kernels.ops import LABELS
    p = sub.add_parser("bench", help="throughput against the link ceiling and the baselines",
                       description=__doc__)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="the small CPU sweep (default without an accelerator)")
    size.add_argument("--full", action="store_true", help="every combination the sweep knows (hours on hardware)")
    for flag, field in DIMENSIONS:
        names = f" ({', '.join(LABELS)})" if field == "ops" else ""
        p.add_argument(flag, metavar="LIST", help=f"comma list: only these {field.replace('_', ' ')}{names}")
    p.add_argument("--out", help="directory for bench.json, bench.png, bench.txt, points.jsonl "
                                 "(default ./kvtier-bench-DATE)")
    p.add_argument("--iters", metavar="N", help="timed calls per point, at most (default 50 on an accelerator; slow points take fewer, "
                        "at least 20 or N)")
    p.add_argument("--time-budget", metavar="S", help="stop measuring new points after this many seconds")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    p.add_argument("--overhead", action="store_true",
                   help="only the host time per call of the hot-path calls beside torch's index ops (no sweep)")
    p.add_argument("--json", metavar="FILE", help="write the host-overhead measurement (with --store: the "
                                                  "store's) to FILE as JSON")
    p.add_argument("--store", metavar="URL",
                   help="only the store tier: prefetch and backup GB/s for 64 KiB-1 MiB pages, and one- and "
                        "four-page latency, beside the store's own raw GET/SET in the same run "
                        "(file:///dir, redis://host:port, ...; docs/store.md)")
    p.add_argument("--latency", action="store_true",
                   help="with --store: only the latency part (one- and four-page backup and prefetch p50/p99 "
                        "beside a raw SET/GET of the same bytes), no throughput")
    p.add_argument("--reshard", action="store_true",
                   help="with --store: only the reshard part (a TP 8 -> TP 2 read beside the same bytes as "
                        "one object per page)")
    p.add_argument("--no-overhead", action="store_true", help="skip the host-overhead benchmark")
    p.add_argument("--interference", action="store_true",
                   help="only a transfer's GB/s beside a concurrent GEMM's slowdown per program cap "
                        "(CUDA; with --smoke a tiny structural run on the CPU)")
    p.add_argument("--quiet", action="store_true", help="no per-point progress lines")
    p.set_defaults(func=run)


def load_bench():
    """kvtier.bench; from the source tree beside this package when the installed
    package list predates it (an editable install made before bench/ existed)."""
    try:
        return importlib.import_module("kvtier.bench")
    except ModuleNotFoundError as e:
        if e.name != "kvtier.bench":
            raise
    root = Path(__file__).resolve().parent.parent / "bench"
    spec = importlib.util.spec_from_file_location("kvtier.bench", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    if spec is None or not (root / "__init__.py").exists():
        raise ModuleNotFoundError("kvtier.bench is not installed", name="kvtier.bench")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvtier.bench"] = module
    spec.loader.exec_module(module)
    return module


# Flags that shape the sweep, which --overhead does not run.
SWEEP_FLAGS = ("--smoke", "--full", *(f for f, _ in DIMENSIONS), "--out", "--iters", "--time-budget",
               "--no-plot")


def _given(args, flag: str):
    return getattr(args, flag[2:].replace("-", "_"))


def _number(args, flag: str, kind, low):
    """The value of a numeric flag (None when absent), at least ``low``."""
    text = _given(args, flag)
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not value >= low:
        raise UsageError(f"{flag}={text!r}: expected {'an int' if kind is int else 'a number'} >= {low}")
    return value


def _dimension(flag: str, text: str) -> tuple:
    """The values one sweep dimension flag asks for, each checked."""
    from kvtier.config import STRATEGIES
    from kvtier.kernels.layouts import NAMES
    from kvtier.kernels.ops import parse_list
    if flag == "--ops":
        return tuple(op.label for op in as_usage(parse_list, text, flag))
    if flag in ("--layouts", "--strategies"):
        return name_list(text, flag, NAMES if flag == "--layouts" else STRATEGIES)
    return int_list(text, flag)


# Flags --interference takes; every other flag is refused with it.
INTERFERENCE_FLAGS = ("--interference", "--smoke", "--ops", "--caps", "--out", "--no-plot", "--quiet")
_ALL_FLAGS = (*SWEEP_FLAGS, "--overhead", "--json", "--no-overhead", "--quiet")
STORE_FLAGS = ("--store", "--json", "--latency", "--reshard", "--quiet")      # what --store takes


def _check_flags(args) -> dict:
    """Combinations and values, refused before anything is measured; the sweep dimensions
    given, by Grid field."""
    for flag in ("--latency", "--reshard"):
        if _given(args, flag) and args.store is None:
            raise UsageError(f"{flag}: measures the store tier; give --store URL with it")
    if args.latency and args.reshard:
        raise UsageError("--reshard: --latency already picks one part; give one of them")
    for mode, takes in (("--store", STORE_FLAGS), ("--interference", INTERFERENCE_FLAGS)):     # (the first given)
        given = [f for f in (*_ALL_FLAGS, "--store", "--interference") if f not in takes
                 and _given(args, f) not in (None, False)]
        if _given(args, mode) not in (None, False) and given:
            raise UsageError(f"{given[0]}: {mode} takes only {' '.join(takes[1:])}")
    if args.no_overhead and (args.overhead or args.json):
        raise UsageError(f"--no-overhead: cannot be combined with {'--overhead' if args.overhead else '--json'}")
    if args.overhead:
        given = [f for f in SWEEP_FLAGS if _given(args, f) not in (None, False)]
        if given:
            raise UsageError(f"{given[0]}: --overhead runs no sweep; drop {' '.join(given)}")
    dims = {field: _dimension(flag, _given(args, flag)) for flag, field in DIMENSIONS
            if _given(args, flag) is not None}
    _number(args, "--iters", int, 1)
    _number(args, "--time-budget", float, 0.0)
    if args.out is not None and not args.out:
        raise UsageError("--out='': empty path")
    if args.json is not None:
        output_file(args.json, "--json")
    return dims


def _sweep(args, bench, on_cpu: bool, dims: dict):
    """The sweep the flags ask for; refused when it has no point to measure."""
    from dataclasses import replace
    base = bench.FULL if args.full else bench.SMOKE if (args.smoke or on_cpu) else bench.HARDWARE
    sweep = bench.sweep.with_overrides(base, **dims)
    iters = _number(args, "--iters", int, 1)
    sweep = replace(sweep, iters=iters, min_iters=min(sweep.min_iters, iters)) if iters else sweep
    shapes = {shape for shape, _, _, _ in sweep.points()}
    if not any(shape.supported() is None for shape in shapes):
        why = next((shape.supported() for shape in shapes), "tokens must be whole pages")
        raise UsageError(f"{_dims_given(args)}: no point to measure ({why})")
    return sweep


def _dims_given(args) -> str:
    return " ".join(f"{flag}={_given(args, flag)}" for flag, _ in DIMENSIONS if _given(args, flag) is not None)


def run(args) -> int:
    dims = _check_flags(args)
    check_environment()
    if args.store is not None:
        return _store(args)
    from kvtier.platforms import default_device, detect_platform
    on_cpu = detect_platform() == "cpu"
    if on_cpu:
        # Triton runs CPU tensors only in its interpreter, chosen before Triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    bench = load_bench()
    from kvtier.bench import report
    from kvtier.bench.overhead import format_overhead, measure_overhead

    device = default_device()
    if args.interference:
        return _interference(args, device, dims)
    if args.overhead:
        overhead = measure_overhead(device)
        print(format_overhead(overhead))
        return _write_json(overhead, args.json)
    sweep = _sweep(args, bench, on_cpu, dims)
    # The largest point's pools (one workload is alive at a time) against the memory here.
    from kvtier.autotune.shape import pool_bytes
    sizes = [pool_bytes(shape.pool_shape(), shape.tokens, spare=1)
             for shape, _, _, _ in sweep.points() if shape.supported() is None]
    check_fits(_dims_given(args) or "the sweep", device, max(sizes), max(sizes))
    out = output_dir(args.out or f"kvtier-bench-{datetime.date.today().isoformat()}", "--out")
    log = None if args.quiet else (lambda line: print(line, flush=True))
    with open(out / "points.jsonl", "w") as stream:   # survives a run that is killed
        def keep(rec):
            stream.write(json.dumps(rec) + "\n")
            stream.flush()
        run_ = bench.run_sweep(sweep, device, log=log, time_budget_s=_number(args, "--time-budget", float, 0.0),
                               on_point=keep)
    if not args.no_overhead:
        run_["overhead"] = measure_overhead(device)
    table = report.format_table(run_)
    summary = report.format_summary(run_)
    text = table + "\n\n" + summary + ("\n" + format_overhead(run_["overhead"]) if "overhead" in run_ else "")
    print("\n" + text)
    (out / "bench.txt").write_text(text + "\n")
    report.write_json(run_, out / "bench.json")
    _plotted(args, out, ["bench.txt", "bench.json", "points.jsonl"], lambda png: report.plot(run_, png), "bench.png")
    rc = 1 if any("error" in p for p in run_["points"]) else 0
    if "overhead" in run_:
        rc = _write_json(run_["overhead"], args.json) or rc
    return rc


def _interference(args, device, dims: dict) -> int:
    """`--interference`: the run, its table, JSON and PNG in --out; one line off CUDA."""
    from kvtier.bench import interference
    from kvtier.platforms.events import can_sleep
    tiny = args.smoke and device.type == "cpu"
    if not can_sleep(device) and not tiny:
        print(interference.SKIP.format(device.type) + " (--smoke runs a tiny structural run on the CPU)")
        return 0
    out = output_dir(args.out or f"kvtier-bench-{datetime.date.today().isoformat()}", "--out")
    setup = interference.with_caps(interference.TINY if tiny else interference.Setup(),
                                   dims.get("program_caps", ()), dims.get("ops", ()))
    result = interference.measure(device, setup, allow_cpu=tiny, log=None if args.quiet else print)
    text = interference.format_text(result)
    print(text)
    (out / "interference.txt").write_text(text + "\n")
    (out / "interference.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    _plotted(args, out, ["interference.txt", "interference.json"], lambda png: interference.plot(result, png),
             "interference.png")
    return 1 if any("error" in r for r in result["rows"]) else 0


def _store(args) -> int:
    """`--store URL`: the store tier's figures (kvtier.store.bench), printed, and in
    --json FILE."""
    from kvtier.errors import KvtierError
    from kvtier.store import bench as store_bench
    if not args.quiet:
        print(f"kvtier bench --store: measuring {args.store} "
              f"({'latency only, seconds' if args.latency else 'reshard only' if args.reshard else 'about a minute'})",
              flush=True)
    only = args.latency or args.reshard
    try:
        result = store_bench.measure(args.store, throughput=not only, latency=not args.reshard,
                                     reshard=not args.latency)
    except KvtierError as e:
        print(f"--store={args.store!r}: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:           # the store lost pages while measured
        print(f"kvtier bench --store: {e}", file=sys.stderr)
        return 1
    print(store_bench.format_text(result))
    return _write_json(result, args.json)


def _plotted(args, out: Path, written: list, plot, png: str) -> None:
    """Draw ``png`` with ``plot`` (unless --no-plot; matplotlib is optional), then say in
    one line what was written to ``out``."""
    if not args.no_plot:
        try:
            plot(out / png)
            written = written + [png]
        except ImportError:
            print("kvtier bench: no PNG: matplotlib is not installed (pip install 'kvtier[bench]')")
    print(f"wrote {', '.join(written)} to {out}")


def _write_json(result: dict, path) -> int:
    """Write ``result`` as JSON where --json asks (0), or say in one line why not (2)."""
    if path is None:
        return 0
    from kvtier.bench.report import write_json
    try:
        write_json(result, path)
    except OSError as e:
        print(f"--json={path!r}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
