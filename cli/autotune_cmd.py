"""`kvtier autotune`: measure the launch configurations of a pool's transfers on this
device, print the table, and cache the winners for the pools; `--show` prints the cache.

On a machine without an accelerator it runs the kernels under Triton's interpreter on a
tiny shape (the machinery, not a performance figure)."""
from __future__ import annotations

import os
import sys
import time

# Shapes used when the user names none: a Llama-8B-like MHA pool on an accelerator, a
# tiny one under the CPU interpreter.
_DEFAULTS = {
    "device": dict(layers=32, heads=8, head_dim=128, page_size=16, rows="256,4096,32768"),
    "cpu": dict(layers=2, heads=2, head_dim=16, page_size=4, rows="16"),
}


# Flags whose default is not None/False (so that --show can refuse every tuning flag given).
_FLAG_DEFAULTS = {"dtype": "bfloat16", "host_layout": "layer_first", "device_layout": "layers",
                  "ops": "backup,load,gather", "codegen_target": "auto", "top": 0}


def register(sub) -> None:
    from kvtier.kernels.codegen import TARGETS
    from kvtier.kernels.layouts import NAMES
    from kvtier.kernels.ops import LABELS
    from kvtier.platforms import PLATFORMS
    from kvtier.flags import non_negative_int, positive_int
    p = sub.add_parser("autotune", help="measure transfer configurations on this device and cache the best",
                       description="Tune the backup/load/gather transfers of a KV pool shape on the current "
                                   "device, print every configuration's GB/s and write the winners to the "
                                   "cache that pools read (KVTIER_CACHE_DIR overrides its directory).")
    p.add_argument("--show", action="store_true", help="print the cached results and exit (takes no other flag)")
    p.add_argument("--layers", type=positive_int, help="model layers (default 32; 2 on CPU)")
    p.add_argument("--heads", type=positive_int, help="KV heads per layer (MHA)")
    p.add_argument("--head-dim", type=positive_int, help="head dim (MHA)")
    p.add_argument("--mla", metavar="RANK,ROPE", help="MLA pool: kv_lora_rank,qk_rope_head_dim (e.g. 512,64)")
    p.add_argument("--dtype", help="KV dtype (bfloat16, float16, float8_e4m3fn, ...)")
    p.add_argument("--page-size", type=positive_int, help="tokens per page (default 16; 4 on CPU)")
    p.add_argument("--host-layout", choices=NAMES, help="host pool layout")
    p.add_argument("--device-layout", choices=("layers", "stacked"),
                   help="one tensor per layer (CUDA engines) or one stacked buffer (Ascend engines)")
    p.add_argument("--ops", help=f"comma list of {', '.join(LABELS)}")
    p.add_argument("--rows", help="comma list of transfer sizes in tokens (default 256,4096,32768; 16 on CPU)")
    p.add_argument("--transfer-layers", help="comma list of layer counts per transfer, each at most --layers "
                                             "(default: all layers)")
    p.add_argument("--max-programs", type=positive_int,
                   help="cap on programs (compute units) a transfer may take; default per device")
    p.add_argument("--quick", action="store_true", help="a smaller search space")
    p.add_argument("--platform", choices=PLATFORMS, help="default: the one detected")
    p.add_argument("--codegen-target", choices=("auto", "none", *sorted(TARGETS)),
                   help="prune configurations that spill when compiled for this target; "
                        "'auto': the device's own, 'none': no pruning")
    p.add_argument("--top", type=non_negative_int, help="print only the N fastest per transfer")
    p.add_argument("--no-write", action="store_true", help="measure and print, but do not write the cache")
    p.set_defaults(func=run, **_FLAG_DEFAULTS)


def run(args) -> int:
    from .args import UsageError, check_environment, platform_device
    if args.show:
        given = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
                 if k not in ("show", "func", "command") and v not in (None, False) and v != _FLAG_DEFAULTS.get(k)]
        if given:
            raise UsageError(f"{given[0]}: --show prints the cache and takes no other flag")
        return show()
    check_environment()
    # (kvtier.platforms imports no Triton: the interpreter must be chosen before Triton is imported)
    from kvtier.platforms import detect_platform
    platform = args.platform or detect_platform()
    device = platform_device(platform, "--platform" if args.platform else "platform")
    if platform == "cpu":
        # Triton runs CPU tensors only in its interpreter, chosen before Triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shape, ops, sizes, layer_counts = _tuning_flags(args, platform, device)
    if not args.no_write:
        from kvtier.autotune.cache import writable_cache_dir
        from kvtier.errors import KvtierError
        try:
            writable_cache_dir()
        except KvtierError as e:
            raise UsageError(f"{e} (or pass --no-write)") from None
    from kvtier.autotune.search import tune
    from kvtier.autotune.report import format_results
    from kvtier.bench.pools import Pools
    from kvtier.kernels.launcher import interpreter_active

    target = None if args.codegen_target == "none" else args.codegen_target
    print(f"kvtier autotune on {platform}: {shape.describe()}; ops {','.join(ops)}; rows {list(sizes)}")
    if platform == "cpu":
        print("  CPU: kernels run " + ("under Triton's interpreter" if interpreter_active()
                                      else "as the torch reference (Triton's interpreter is off)")
              + "; the figures test the machinery, not a device")
    bar = ProgressBar(sys.stderr)
    try:
        results = tune(shape, pools=Pools, ops=ops, sizes=sizes, layer_counts=layer_counts, platform=platform,
                       max_programs=args.max_programs, quick=args.quick or platform == "cpu",
                       target=target, write=not args.no_write, progress=bar)
    except ValueError as e:
        bar.close()
        print(f"kvtier autotune: {e}", file=sys.stderr)
        return 2
    bar.close()
    print(format_results(results, top=args.top))
    if not args.no_write:
        from kvtier.autotune.cache import cache_path
        from kvtier.autotune.key import device_identity
        print(f"written: {cache_path(device_identity(platform))}")
    return 0 if all(r.best is not None for r in results) else 1


def _tuning_flags(args, platform: str, device):
    """(PoolShape, op labels, sizes, layer counts or None) from the flags, each checked,
    and the pools they ask for checked against this machine's memory."""
    import torch
    from kvtier.autotune.shape import PoolShape, pool_bytes
    from kvtier.kernels.ops import parse_list
    from .args import UsageError, as_usage, check_fits, int_list
    d = _DEFAULTS["cpu" if platform == "cpu" else "device"]
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"--dtype={args.dtype!r}: not a torch dtype")
    ops = as_usage(parse_list, args.ops, "--ops")
    sizes = int_list(args.rows if args.rows is not None else d["rows"], "--rows")
    layers = args.layers or d["layers"]
    layer_counts = None
    if args.transfer_layers is not None:
        layer_counts = int_list(args.transfer_layers, "--transfer-layers")
        if max(layer_counts) > layers:
            raise UsageError(f"--transfer-layers={args.transfer_layers!r}: at most --layers={layers}")
    common = dict(dtype=dtype, page_size=args.page_size or d["page_size"], host_layout=args.host_layout,
                  device_layout=args.device_layout)
    if args.mla is not None:
        if args.heads or args.head_dim:
            raise UsageError(f"{'--heads' if args.heads else '--head-dim'}: an MLA row is --mla's; drop it")
        dims = int_list(args.mla, "--mla")
        if len(dims) != 2:
            raise UsageError(f"--mla={args.mla!r}: must be kv_lora_rank,qk_rope_head_dim")
        shape = PoolShape.mla(layers, *dims, **common)
        size_flags = f"--layers={layers} --mla={args.mla}"
    else:
        shape = PoolShape.mha(layers, args.heads or d["heads"], args.head_dim or d["head_dim"], **common)
        size_flags = f"--layers={layers} --heads={shape.row_dims[0]} --head-dim={shape.row_dims[1]}"
    # Every pool of the run is alive at once: one pair per (layers moved, size).
    counts = set(layer_counts or (layers,)) | ({layers} if any(op.scope == "layer" for op in ops) else set())
    nbytes = sum(pool_bytes(shape, n, layers=c) for c in counts for n in sizes)
    check_fits(f"{size_flags} --page-size={shape.page_size} --dtype={args.dtype} --rows={','.join(map(str, sizes))}"
               + (f" --transfer-layers={args.transfer_layers}" if layer_counts else ""), device, nbytes, nbytes)
    return shape, [op.label for op in ops], sizes, layer_counts


def show() -> int:
    from kvtier.autotune import cache
    from kvtier.autotune.report import format_cache
    from .args import UsageError
    name, d = cache.cache_location()
    if d.exists() and not d.is_dir():
        raise UsageError(f"{name}={str(d)!r}: not a directory")
    files = sorted(d.glob("autotune-*.json")) if d.is_dir() else []
    if not files:
        print(f"no autotune results in {d} (run `kvtier autotune`)")
        return 0
    from kvtier.autotune.key import DeviceId
    import json
    for path in files:
        try:
            dev = DeviceId(**json.loads(path.read_text())["device"])
        except Exception as e:
            print(f"{path}: unreadable ({type(e).__name__}: {e}); ignored")
            continue
        print(format_cache(path, cache.entries(dev, path)))
    return 0


class ProgressBar:
    """A one-line text progress bar (redrawn with '\\r' on a terminal, a line per 10%
    otherwise)."""

    def __init__(self, stream, width: int = 30):
        self.stream, self.width = stream, width
        self.tty = getattr(stream, "isatty", lambda: False)()
        self.t0, self.last_decile, self.drawn = time.time(), -1, False

    def __call__(self, done: int, total: int, label: str) -> None:
        fill = self.width * done // max(total, 1)
        line = (f"[{'#' * fill}{'.' * (self.width - fill)}] {done}/{total} "
                f"{time.time() - self.t0:5.1f}s {label}")
        decile = 10 * done // max(total, 1)
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
        elif decile != self.last_decile or done == total:
            self.stream.write(line + "\n")
        self.last_decile, self.drawn = decile, True
        self.stream.flush()

    def close(self) -> None:
        if self.drawn and self.tty:
            self.stream.write("\n")
            self.stream.flush()
