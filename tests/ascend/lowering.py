"""Lower the row-copy kernel with triton-ascend, without an NPU, and read the result.

- `recorded_launches(floors)` runs the real launcher (`kvtier.kernels.launcher`) with the
  kernel replaced by a recorder and the platform floors of an NPU (its `_floors` seam), so
  the configurations checked are exactly what the launcher produces on an NPU: constants,
  argument types (word-typed pointers, int32/int64 indices) and ints.
- `lower(launch)` compiles one recorded launch for ``GPUTarget("npu", "Ascend910B3", 0)``
  through every stage before the final binary (which needs CANN): TTIR, then
  triton-ascend's adapter to its linalg/HIVM form, and returns that text.
- `copies(text, ...)` reads the lowered function: how global memory is read and written.
  A row moved as one contiguous copy appears as ``memref.reinterpret_cast`` of the source
  with sizes ``[1, W]`` and strides ``[W, 1]`` feeding ``memref.copy`` into the Unified
  Buffer, and the same shape feeding ``bufferization.materialize_in_destination`` on the
  way out; an element-by-element copy would show scalar ``memref.load``/``memref.store``
  on the data instead.

Needs triton-ascend (its own venv; see .ci/ascend.sh).
"""
from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, field

TARGET = ("npu", "Ascend910B3", 0)
DATA_ARGS = ()      # every data pointer is cast from an int: a side's base, or a table entry
INDEX_ARGS = ("src_idx", "dst_idx")
TABLE_ARGS = ("src_table", "dst_table")


class LoweringError(RuntimeError):
    """A stage before the binary failed; the message has the stage and the tool's error."""


@dataclass
class Launch:
    grid: tuple
    args: dict          # runtime argument name -> tensor or int
    constants: dict     # constexpr name -> value
    kernel: str = "copy"    # "copy" (the row copy) or "check" (the index check)

    def key(self):
        from triton.runtime.jit import mangle_type
        return (tuple(sorted((k, mangle_type(v)) for k, v in self.args.items())),
                tuple(sorted(self.constants.items())))


def interpreter_patched() -> bool:
    """Whether triton-ascend's interpreter has run in this process: Triton 3.2 patches
    triton.language for it and never restores it, after which nothing compiles here."""
    import triton.language as tl
    return "__index__" in vars(tl.core.tensor)


def kernel_fn(kernel: str = "copy"):
    """The kernel as a JITFunction, also when TRITON_INTERPRET=1 made it an interpreted one."""
    from kvtier.kernels.codegen import compilable
    if kernel == "check":
        from kvtier.kernels.index_check_kernel import check_indices_jit as k
    else:
        from kvtier.kernels.copy_rows_kernel import copy_rows_jit as k
    return compilable(k)


class _Recorder:
    def __init__(self, fn, launches, kernel="copy"):
        self.names, self.launches, self.kernel = fn.arg_names, launches, kernel
        self.constexprs = {p.name for p in fn.params if p.is_constexpr}

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            kwargs.pop("num_warps", None)
            values = dict(zip(self.names, args), **kwargs)      # constants by position or keyword
            constants = {k: values.pop(k) for k in self.names if k in self.constexprs}
            self.launches.append(Launch(tuple(grid), values, constants, self.kernel))
        return run


@contextmanager
def recorded_launches(floors: dict, checks: list = None):
    """Within the block, `copy_rows` records its kernel launches instead of running them,
    planning them with ``floors`` (tile_copy's min_rows / min_piece_bytes) as on an NPU.
    The index-check kernel's launches are recorded into ``checks`` (a list) and not run
    either: running any kernel under triton-ascend's interpreter would stop this process
    from compiling."""
    launcher = importlib.import_module("kvtier.kernels.launcher")
    check_mod = importlib.import_module("kvtier.kernels.index_check_kernel")
    platforms = importlib.import_module("kvtier.platforms")
    launches = []
    rec = _Recorder(kernel_fn(), launches)
    check_rec = _Recorder(kernel_fn("check"), checks if checks is not None else [], "check")
    npu_like = dataclasses.replace(platforms.get("cpu"), **floors)
    saved = (launcher._kernel, launcher.interpreter_active, launcher._platform, launcher._RUNNERS,
             check_mod.check_indices_jit)
    launcher._kernel, launcher.interpreter_active = (lambda: rec), (lambda: True)
    launcher._platform = lambda device: npu_like
    launcher._RUNNERS = {"cpu": "kernel"}
    check_mod.check_indices_jit = check_rec
    try:
        yield launches
    finally:
        (launcher._kernel, launcher.interpreter_active, launcher._platform, launcher._RUNNERS,
         check_mod.check_indices_jit) = saved


def source(launch: Launch):
    """The ASTSource triton-ascend would build for this launch: pointer types from the
    tensors, ints typed as Triton types them, and ints equal to 1 specialised to
    constants (as Triton does at launch, except for the kernel's ``do_not_specialize``
    arguments)."""
    from triton.compiler.compiler import ASTSource
    sig, constants = signature(launch)
    return ASTSource(fn=kernel_fn(launch.kernel), signature=sig, constants=constants)


def signature(launch: Launch):
    """(signature, constants) of the launch, as plain data."""
    from triton.runtime.jit import mangle_type
    fn = kernel_fn(launch.kernel)
    constants = dict(launch.constants)
    plain = {p.name for p in fn.params if p.do_not_specialize}     # never specialised on
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
            continue
        v = launch.args[name]
        if isinstance(v, int) and not isinstance(v, bool) and v == 1 and name not in plain:
            constants[name] = 1
            sig[name] = "constexpr"
        else:
            sig[name] = mangle_type(v)
    return sig, constants


def lower_apart(launch: Launch, timeout: int = 600) -> str:
    """Lower ``launch`` in a fresh process without Triton's interpreter (a kernel that uses
    Triton's reductions cannot compile where TRITON_INTERPRET=1 made their helpers
    interpreted functions); returns that process's report, raises LoweringError."""
    import json
    import os
    import sys
    sig, constants = signature(launch)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__], input=json.dumps(
        {"kernel": launch.kernel, "signature": sig, "constants": constants}), env=env,
        capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise LoweringError((r.stderr or r.stdout).strip().splitlines()[-1] if (r.stderr or r.stdout) else
                            f"exit {r.returncode}")
    return r.stdout


def lower(launch: Launch) -> "Lowered":
    """Run every stage before the binary; raise LoweringError naming the failing stage."""
    return lower_source(source(launch))


def lower_source(src) -> "Lowered":
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    target = GPUTarget(*TARGET)
    backend = make_backend(target)
    options = backend.parse_options({})
    stages = {}
    backend.add_stages(stages, options)
    names = list(stages)
    if names[-1] != "npubin":
        raise LoweringError(f"unexpected triton-ascend stages {names}: the last should be npubin")
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    module = src.make_ir(options, backend.get_codegen_implementation(), backend.get_module_map(), ctx)
    metadata = {"hash": src.hash(), "target": target, **options.__dict__}
    for stage in names[:-1]:
        module = _run_stage(stages[stage], stage, module, metadata)
    return Lowered(str(module), src.signature, src.constants)


def _run_stage(run, stage, module, metadata, tries: int = 5):
    """One stage; triton-adapter-opt 3.2.0 now and then dies on an internal assertion
    (now and then, a different kernel each time, more often under load), so a death by
    signal is retried.
    A deterministic failure fails every try and is raised."""
    for attempt in range(tries):
        try:
            return run(module, metadata)
        except subprocess.CalledProcessError as e:
            if e.returncode < 0 and attempt + 1 < tries:
                continue
            err = (e.stderr or b"").decode(errors="replace")
            lines = [l for l in err.splitlines() if l and not l.lstrip().startswith("#")][:8]
            raise LoweringError(f"stage {stage} failed (exit {e.returncode}, try {attempt + 1}): "
                                + "\n".join(lines)) from None


@dataclass
class Lowered:
    text: str
    signature: dict
    constants: dict
    arg: dict = field(default_factory=dict)    # kernel argument name -> %argN in the text

    def __post_init__(self):
        attrs = dict(re.findall(r"\b(SyncBlockLockArgIdx|WorkspaceArgIdx) = (\d+)", self.text))
        first = max((int(v) + 1 for v in attrs.values()), default=0)
        runtime = [n for n, t in self.signature.items() if t != "constexpr"]
        self.arg = {n: f"%arg{first + i}" for i, n in enumerate(runtime)}


_CAST = re.compile(r"(%[\w]+) = memref\.reinterpret_cast (%[\w]+) to offset: \[[^\]]*\], "
                   r"sizes: \[([^\]]*)\], strides: \[([^\]]*)\] : memref<\?x(\w+)>")
_PTR_CAST = re.compile(r"(%[\w]+) = hivm\.hir\.pointer_cast\(")
_LOAD = re.compile(r"memref\.load (%[\w]+)\[")
_COPY = re.compile(r"memref\.copy (%[\w]+), (%[\w]+)")
_OUT = re.compile(r"materialize_in_destination (%[\w]+) in writable (%[\w]+)")
_ALLOC = re.compile(r"memref\.alloc\(\) : memref<([\dx]+)x([a-z]+\d+)>")


@dataclass
class Copies:
    loads: list         # widths (elements) of global -> UB row copies
    stores: list        # widths of UB -> global row writes
    elem_types: set     # element types of the data copies
    scalar_data: list   # scalar loads/stores that touch the data buffers (must be empty)
    bad_shapes: list    # data views that are not one contiguous row
    masks: int          # integer compares / selects anywhere in the kernel
    tile_bytes: list    # Unified Buffer allocations, bytes


def copies(low: Lowered) -> Copies:
    text = low.text
    data_roots = {low.arg[n] for n in DATA_ARGS if n in low.arg}
    data_roots |= set(_PTR_CAST.findall(text))       # int64 -> pointer casts (bases and table entries)
    loads, stores, elems, bad, scalar = [], [], set(), [], []
    # SSA names repeat across sibling regions (%reinterpret_cast in every loop body), so
    # views are resolved against the definitions visible in the enclosing regions.
    scopes = [{}]

    def view(name):
        for scope in reversed(scopes):
            if name in scope:
                c = scope[name]
                return c if c[0] in data_roots else None
        return None

    for line in text.splitlines():
        if line.lstrip().startswith("}"):
            scopes.pop()
        for res, root, sizes, strides, elem in _CAST.findall(line):
            scopes[-1][res] = (root, [x.strip() for x in sizes.split(",")],
                               [x.strip() for x in strides.split(",")], elem)
        m = _COPY.search(line)
        if m and view(m.group(1)):
            loads.append(_row_width(view(m.group(1)), bad))
            elems.add(view(m.group(1))[3])
        m = _OUT.search(line)
        if m and view(m.group(2)):
            stores.append(_row_width(view(m.group(2)), bad))
            elems.add(view(m.group(2))[3])
        m = _LOAD.search(line)
        if (m and view(m.group(1))) or "memref.store" in line:
            scalar.append(line.strip())
        if line.rstrip().endswith("{"):
            scopes.append({})
    masks = len(re.findall(r"arith\.cmpi|arith\.select", text))
    tiles = []
    for dims, elem in _ALLOC.findall(text):
        n = 1
        for d in dims.split("x"):
            n *= int(d)
        tiles.append(n * int(re.sub(r"\D", "", elem)) // 8)
    return Copies(loads, stores, elems, scalar, bad, masks, tiles)


def _row_width(cast, bad) -> int:
    _, sizes, strides, _ = cast
    if len(sizes) == 2 and sizes[0] == "1" and strides[1] == "1" and sizes[1].isdigit():
        return int(sizes[1])
    bad.append((sizes, strides))
    return -1


def expected_widths(constants: dict) -> list:
    """Widths (words) of the pieces the kernel copies per row chunk: BLOCK-wide pieces for
    the part of the chunk that fills whole blocks, one power-of-two piece per set bit of
    the tail of at least MIN_PIECE words, and one MIN_PIECE-word window (ending at the
    chunk's end) in place of the tail bits below MIN_PIECE."""
    chunk, block = constants["CHUNK_WORDS"], constants["BLOCK"]
    least = constants.get("MIN_PIECE", 1)
    main, tail = (chunk // block) * block, chunk % block
    widths = [block] if main else []
    widths += [1 << k for k in range(block.bit_length()) if (tail >> k) & 1 and (1 << k) >= least]
    return widths + ([least] if tail % least else [])


if __name__ == "__main__":      # lower_apart's child: one launch as JSON on stdin
    import json
    import sys
    from triton.compiler.compiler import ASTSource
    job = json.load(sys.stdin)
    low = lower_source(ASTSource(fn=kernel_fn(job["kernel"]), signature=job["signature"],
                                 constants=job["constants"]))
    print(f"lowered {job['kernel']}: {len(low.text)} characters of linalg/HIVM")
