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


def register(sub) -> None:
    from kvtier.kernels.ops import LABELS
    from kvtier.platforms import PLATFORMS
    from .args import non_negative_int, positive_int
    p = sub.add_parser("autotune", help="measure transfer configurations on this device and cache the best",
                       description="Tune the backup/load/gather transfers of a KV pool shape on the current "
                                   "device, print every configuration's GB/s and write the winners to the "
                                   "cache that pools read (KVTIER_CACHE_DIR overrides its directory).")
    p.add_argument("--show", action="store_true", help="print the cached results and exit")
    p.add_argument("--layers", type=positive_int, help="model layers (default 32; 2 on CPU)")
    p.add_argument("--heads", type=positive_int, help="KV heads per layer (MHA)")
    p.add_argument("--head-dim", type=positive_int, help="head dim (MHA)")
    p.add_argument("--mla", metavar="RANK,ROPE", help="MLA pool: kv_lora_rank,qk_rope_head_dim (e.g. 512,64)")
    p.add_argument("--dtype", default="bfloat16", help="KV dtype (bfloat16, float16, float8_e4m3fn, ...)")
    p.add_argument("--page-size", type=positive_int, help="tokens per page (default 16; 4 on CPU)")
    p.add_argument("--host-layout", default="layer_first",
                   help="layer_first, page_first, page_first_direct or page_head")
    p.add_argument("--device-layout", default="layers", choices=("layers", "stacked"),
                   help="one tensor per layer (CUDA engines) or one stacked buffer (Ascend engines)")
    p.add_argument("--ops", default="backup,load,gather", help=f"comma list of {', '.join(LABELS)}")
    p.add_argument("--rows", help="comma list of transfer sizes in tokens (default 256,4096,32768; 16 on CPU)")
    p.add_argument("--transfer-layers", help="comma list of layer counts per transfer (default: all layers)")
    p.add_argument("--max-programs", type=positive_int,
                   help="cap on programs (compute units) a transfer may take; default per device")
    p.add_argument("--quick", action="store_true", help="a smaller search space")
    p.add_argument("--platform", choices=PLATFORMS, help="default: the one detected")
    p.add_argument("--codegen-target", default="auto",
                   help="prune configurations that spill when compiled for this target (sm90, gfx942); "
                        "'auto': the device's own, 'none': no pruning")
    p.add_argument("--top", type=non_negative_int, default=0, help="print only the N fastest per transfer")
    p.add_argument("--no-write", action="store_true", help="measure and print, but do not write the cache")
    p.set_defaults(func=run)


def run(args) -> int:
    platform = args.platform or _platform()
    if platform == "cpu":
        # Triton runs CPU tensors only in its interpreter, chosen before Triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.show:
        return show()
    import torch
    from kvtier.kernels.errors import KvtierError
    from kvtier.kernels.ops import parse_list
    from kvtier.autotune.search import tune
    from kvtier.autotune.report import format_results
    from kvtier.autotune.workload import PoolShape
    from kvtier.kernels.copy_rows import interpreter_active

    d = _DEFAULTS["cpu" if platform == "cpu" else "device"]
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        print(f"--dtype {args.dtype!r}: not a torch dtype", file=sys.stderr)
        return 2
    try:
        ops = [op.label for op in parse_list(args.ops, "--ops")]
    except KvtierError as e:
        print(str(e), file=sys.stderr)
        return 2
    try:
        sizes = _ints(args.rows or d["rows"], "--rows")
        layer_counts = _ints(args.transfer_layers, "--transfer-layers") if args.transfer_layers else None
        common = dict(dtype=dtype, page_size=args.page_size or d["page_size"], host_layout=args.host_layout,
                      device_layout=args.device_layout)
        layers = args.layers or d["layers"]
        if args.mla:
            dims = _ints(args.mla, "--mla")
            if len(dims) != 2:
                raise ValueError(f"--mla {args.mla!r}: must be kv_lora_rank,qk_rope_head_dim")
            rank, rope = dims
            shape = PoolShape.mla(layers, rank, rope, **common)
        else:
            shape = PoolShape.mha(layers, args.heads or d["heads"], args.head_dim or d["head_dim"], **common)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    target = None if args.codegen_target == "none" else args.codegen_target
    print(f"kvtier autotune on {platform}: {shape.describe()}; ops {','.join(ops)}; rows {sizes}")
    if platform == "cpu":
        print("  CPU: kernels run " + ("under Triton's interpreter" if interpreter_active()
                                      else "as the torch reference (Triton's interpreter is off)")
              + "; the figures test the machinery, not a device")
    bar = ProgressBar(sys.stderr)
    try:
        results = tune(shape, ops=ops, sizes=sizes, layer_counts=layer_counts, platform=platform,
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


def show() -> int:
    from kvtier.autotune import cache
    from kvtier.autotune.report import format_cache
    d = cache.cache_dir()
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


def _platform() -> str:
    """The platform to tune (kvtier.platforms imports no Triton: the interpreter must be
    chosen before Triton is imported)."""
    from kvtier.platforms import detect_platform
    return detect_platform()


def _ints(text: str, arg: str) -> list:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"{arg} {text!r}: must be a comma list of positive integers")
    return out


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
