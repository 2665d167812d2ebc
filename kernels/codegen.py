"""Codegen report: compile the row-copy kernel for a named GPU target without a GPU
and report, per configuration, the global access widths and register use.

- sm90 (CUDA, H100/H200): PTX is parsed for ``ld.global``/``st.global`` widths and the
  pipelined structure: ``cp.async`` copies (global -> shared, issued stages ahead) with
  their widths, commit groups and the ``cp.async.wait_group`` depths; the cubin is read
  by the cuobjdump that ships with Triton (``--dump-resource-usage``) for registers and
  spill stores/loads.
- gfx942 (ROCm, MI300): the AMDGCN assembly gives ``global_load/store`` widths and its
  metadata ``.vgpr_count`` / ``.vgpr_spill_count`` / ``.sgpr_spill_count``.

Only community Triton (3.6+) has the APIs used here; Ascend lowering is checked by the
tests under tests/ascend with triton-ascend.
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field, asdict
from typing import Optional

from kvtier.config import CopyConfig
from .direct_launch import interpreted

TARGETS = {
    "sm90": ("cuda", 90, 32),
    "sm80": ("cuda", 80, 32),
    "gfx942": ("hip", "gfx942", 64),
}

_PTX_ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[a-z0-9_]+)*?(?:\.v(\d))?\.[bsuf](\d+)\b")
_CP_ASYNC = re.compile(r"\bcp\.async\.c[ag]\.shared\.global(?:\.[a-zA-Z0-9_:]+)*\s+\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-fA-F]+|\d+)")
_WAIT_GROUP = re.compile(r"\bcp\.async\.wait_group\s+(\d+)")
_GCN_ACCESS = re.compile(r"\bglobal_(load|store)_(dwordx4|dwordx3|dwordx2|dword|short|ushort|sshort|byte|ubyte|sbyte|b128|b96|b64|b32|b16|b8|u8|u16|i8|i16)\b")
_GCN_BYTES = {"dwordx4": 16, "b128": 16, "dwordx3": 12, "b96": 12, "dwordx2": 8, "b64": 8,
              "dword": 4, "b32": 4, "short": 2, "ushort": 2, "sshort": 2, "b16": 2, "u16": 2,
              "i16": 2, "byte": 1, "ubyte": 1, "sbyte": 1, "b8": 1, "u8": 1, "i8": 1}


@dataclass
class KernelReport:
    """What one compiled configuration does with global memory and registers."""
    target: str
    config: dict
    shape: dict
    load_widths: dict = field(default_factory=dict)    # bytes per access -> count in the code
    store_widths: dict = field(default_factory=dict)
    cp_async: int = 0                                  # cp.async.* instructions in the PTX
    cp_async_widths: dict = field(default_factory=dict)  # bytes per cp.async -> count
    registers: Optional[int] = None
    spills: Optional[int] = None                       # bytes (CUDA) or registers (AMD) spilled
    shared: Optional[int] = None                       # shared memory bytes (pipeline buffers)
    pipeline: dict = field(default_factory=dict)       # stages, constants, commit/wait groups
    error: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KernelReport":
        """A `to_dict` read back from JSON (whose keys are strings: access widths are ints)."""
        widths = ("load_widths", "store_widths", "cp_async_widths")
        return cls(**{k: ({int(w): n for w, n in v.items()} if k in widths else v) for k, v in d.items()})

    def row(self) -> str:
        if self.error:
            return f"{self.target:7s} {_cfg(self.config):34s} {_shape(self.shape):44s} ERROR {self.error}"
        fmt = lambda d: ",".join(f"{w}Bx{n}" for w, n in sorted(d.items(), reverse=True)) or "-"
        return (f"{self.target:7s} {_cfg(self.config):34s} {_shape(self.shape):44s} "
                f"ld {fmt(self.load_widths):22s} st {fmt(self.store_widths):14s} "
                f"cp.async {fmt(self.cp_async_widths):10s} "
                f"regs {self.registers if self.registers is not None else '?':>3} "
                f"spills {self.spills if self.spills is not None else '?'} "
                f"smem {self.shared if self.shared is not None else '?'}")


def _cfg(c: dict) -> str:
    return (f"progs={c['num_programs']} rows={c['rows']} block={c['block_bytes']} warps={c['num_warps']} "
            f"stages={c.get('stages', 1)} tile={c.get('tile_bytes', 0)}")


def _shape(s: dict) -> str:
    modes = ("T" if s["src_table"] else "S") + "->" + ("T" if s["dst_table"] else "S")
    return (f"{modes} row={s['row_bytes']}B chunks={s['n_chunks']} P={s['page_size']} C={s['num_components']} "
            f"off{s.get('offset_bits', 64)}")


def compile_report(target: str = "sm90", *, config: Optional[CopyConfig] = None, row_bytes: int = 1024,
                   src_table: bool = True, dst_table: bool = False, page_size: int = 1,
                   n_chunks: int = 1, num_components: int = 1, align: int = 16,
                   index_bits: int = 64, offset_bits: int = 32, check: int = 2,
                   check_tables: bool = False) -> KernelReport:
    """Compile one kernel configuration for ``target`` and report on it (never raises
    for a compile failure: the report's ``error`` says what went wrong). ``offset_bits``:
    32 describes layers spanning under 2 GiB (row offsets in 32 bits), 64 larger ones.
    ``check``: how the launch checks its index lists (2: inline, as link copies do; 1: by
    a check launch's verdict, as device copies do; 0: not); ``check_tables``: it also
    checks an engine table's entries."""
    config = config or CopyConfig()
    shape = dict(row_bytes=row_bytes, src_table=src_table, dst_table=dst_table, page_size=page_size,
                 n_chunks=n_chunks, num_components=num_components, align=align, index_bits=index_bits,
                 offset_bits=offset_bits, check=check, check_tables=check_tables)
    if target in TARGETS and _interpreter_ran_here():       # one request: compile_reports' child
        return compile_reports([(target, config, shape)])[0]
    return _report(target, config, shape)


def compile_reports(requests) -> list:
    """`compile_report` for each ``(target, config, shape)`` of ``requests`` (``shape``:
    its keyword arguments), in one process of their own where Triton's interpreter is on
    in this one: the interpreter leaves ``triton.language`` patched after a kernel that
    calls a jitted helper (a reduction, for one), and nothing compiles in that process
    afterwards."""
    if not _interpreter_ran_here():
        return [compile_report(t, config=c, **sh) for t, c, sh in requests]
    # Each shape as compile_report completes it (its defaults), from its own signature.
    defaults = {k: p.default for k, p in inspect.signature(compile_report).parameters.items()
                if p.kind is p.KEYWORD_ONLY and k != "config"}
    requests = [(t, c or CopyConfig(), dict(defaults, **sh)) for t, c, sh in requests]
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    todo = [{"target": t, "config": c.to_dict(), "shape": sh} for t, c, sh in requests]
    r = subprocess.run([sys.executable, "-m", "kvtier.kernels.codegen"], input=json.dumps(todo), env=env,
                       capture_output=True, text=True, timeout=600 + 60 * len(todo))
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:200]
        return [KernelReport(target=t, config=c.to_dict(), shape=sh, error=f"compile process failed: {why}")
                for t, c, sh in requests]
    return [KernelReport.from_dict(d) for d in json.loads(r.stdout)]


def _interpreter_ran_here() -> bool:
    """Whether Triton runs kernels in its interpreter in this process (then compiling
    here may fail: see `compile_reports`)."""
    from .launcher import interpreter_active
    return interpreter_active()


def _report(target: str, config: CopyConfig, shape: dict) -> KernelReport:
    rep = KernelReport(target=target, config=config.to_dict(), shape=dict(shape))
    if target not in TARGETS:
        rep.error = f"unknown target {target!r}; choose from {sorted(TARGETS)}"
        return rep
    try:
        compiled = _compile(target, config, shape)
    except Exception as e:  # report, don't crash: a sweep wants every row
        rep.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        return rep
    const = kernel_constants(config, dict(shape, target=target))
    rep.pipeline = dict(stages=const["STAGES"], rows=const["ROWS"], block_words=const["BLOCK"],
                        word=const["WORD"], split=const["SPLIT"], offsets_32bit=const["SRC_I32"])
    rep.shared = getattr(compiled.metadata, "shared", None)
    _FILL[TARGETS[target][0]](rep, compiled)
    return rep


def kernel_constants(config: CopyConfig, shape: dict) -> dict:
    """The compile-time constants the launcher would pass for this shape and config."""
    from .tiling import Geometry, kernel_constants as constants
    side = dict(page_size=shape["page_size"], num_components=shape["num_components"],
                n_chunks=shape["n_chunks"], chunk_bytes=shape["row_bytes"] // shape["n_chunks"],
                align=shape["align"], span=1 << (30 if shape.get("offset_bits", 64) == 32 else 34))
    warp = TARGETS[shape.get("target", "sm90")][2]
    const = constants(Geometry(shape["src_table"], **side), Geometry(shape["dst_table"], **side), 1 << 20,
                      config, threads=config.num_warps * warp)
    # Link copies (few programs) check their lists inline; device copies read a check
    # launch's verdict (`check` 1); engine tables add their entries' check.
    return dict(const, SRC_TSPLIT=shape["num_components"], DST_TSPLIT=shape["num_components"],
                CHECK=shape.get("check", 2), SKIP_NEG=shape.get("skip_negative", False),
                SRC_WHOLE=shape.get("whole", 1), DST_WHOLE=shape.get("whole", 1),
                CHECK_TABLES=bool(shape.get("check_tables", False)), CHECK_BLOCK=1024)


def _compile(target: str, config: CopyConfig, shape: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from .copy_rows_kernel import copy_rows_jit
    const = kernel_constants(config, dict(shape, target=target))
    idx = f"*i{shape['index_bits']}"
    word = "*i32" if const["CHECK"] == 1 else "*i64"     # the verdict, or the failure record
    ptrs = {"src_table": "*i64", "dst_table": "*i64", "src_table2": "*i64", "dst_table2": "*i64",
            "src_idx": idx, "dst_idx": idx, "verdict": word, "record": word}
    # Dense index lists: Triton specializes their stride of 1 to a constant at launch.
    const = dict(const, src_idx_stride=1, dst_idx_stride=1)
    # Counts are i32 as Triton types them at launch; addresses and strides i64 (the widest case).
    counts = ("n_idx", "n_rows", "src_limit", "dst_limit", "src_arg", "dst_arg", "src_targ", "dst_targ", "n_layers",
              "src_layer0", "dst_layer0", "src_t_comp", "src_t_layer", "dst_t_comp", "dst_t_layer")
    names = copy_rows_jit.arg_names
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i32" if n in counts else "i64") for n in names}
    # Pointer arguments from torch allocations are 16-byte aligned; Triton specializes them so.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ptrs}
    src = ASTSource(fn=compilable(copy_rows_jit), signature=sig, constexprs=const, attrs=attrs)
    kind, arch, warp = TARGETS[target]
    options = {"num_warps": config.num_warps}
    return triton.compile(src, target=GPUTarget(kind, arch, warp), options=options)


def compilable(kernel):
    """The kernel as a JITFunction, also when Triton's interpreter wrapped it (the
    compiler needs the JIT form; the interpreter form only runs on CPU tensors, and
    drops the arguments its module does not specialize on, ``NOT_SPECIALIZED``). The
    jitted functions it calls are handed to the compiler in their JIT form too."""
    import sys
    from triton.runtime.jit import JITFunction
    if isinstance(kernel, JITFunction):
        return kernel
    plain = getattr(sys.modules[kernel.fn.__module__], "NOT_SPECIALIZED", ())
    return JITFunction(_calling_jit(kernel.fn), do_not_specialize=list(plain))


def _calling_jit(fn, copies=None):
    """``fn`` over a copy of its module's globals in which every interpreted jitted
    function is its JIT form (each built the same way; ``copies``: the globals copied so
    far, one per module, so functions that call each other resolve)."""
    import types
    from triton.runtime.jit import JITFunction
    copies = {} if copies is None else copies
    g = fn.__globals__
    new = copies.get(id(g))
    if new is None:
        new = copies[id(g)] = dict(g)
        for name, v in g.items():
            if interpreted(v) and hasattr(v, "fn"):
                new[name] = JITFunction(_calling_jit(v.fn, copies))
    out = types.FunctionType(fn.__code__, new, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__module__, out.__qualname__, out.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
    out.__annotations__ = dict(fn.__annotations__)
    return out


def _fill_cuda(rep: KernelReport, compiled) -> None:
    loads, stores = Counter(), Counter()
    ptx = compiled.asm["ptx"]
    for op, vec, bits in _PTX_ACCESS.findall(ptx):
        (loads if op == "ld" else stores)[int(vec or 1) * int(bits) // 8] += 1
    rep.load_widths, rep.store_widths = dict(loads), dict(stores)
    rep.cp_async_widths = dict(Counter(int(n, 0) for n in _CP_ASYNC.findall(ptx)))
    rep.cp_async = len(re.findall(r"\bcp\.async\.", ptx))
    rep.pipeline.update(commit_groups=len(re.findall(r"\bcp\.async\.commit_group\b", ptx)),
                        wait_groups=sorted({int(n) for n in _WAIT_GROUP.findall(ptx)}))
    cubin = compiled.asm.get("cubin")
    if cubin is None:
        return
    usage = cuobjdump_usage(cubin)
    if usage:
        rep.registers = usage.get("REG")
        rep.spills = usage.get("STACK", 0) + usage.get("LOCAL", 0)


def cuobjdump_usage(cubin: bytes) -> dict:
    """REG / STACK / LOCAL / SHARED from ``cuobjdump --dump-resource-usage``."""
    tool = _nvidia_tool("cuobjdump")
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True,
                             timeout=60).stdout
    finally:
        os.unlink(path)
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def _nvidia_tool(name: str) -> Optional[str]:
    try:
        import triton
        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
        return path if os.path.exists(path) else None
    except ImportError:
        return None


def _fill_amd(rep: KernelReport, compiled) -> None:
    asm = compiled.asm.get("amdgcn", "")
    loads, stores = Counter(), Counter()
    for op, kind in _GCN_ACCESS.findall(asm):
        (loads if op == "load" else stores)[_GCN_BYTES[kind]] += 1
    rep.load_widths, rep.store_widths = dict(loads), dict(stores)
    get = lambda key: [int(v) for v in re.findall(rf"\.{key}:\s*(\d+)", asm)]
    vgprs = get("vgpr_count")
    rep.registers = max(vgprs) if vgprs else None
    spills = get("vgpr_spill_count") + get("sgpr_spill_count")
    rep.spills = sum(spills) if spills else None


SWEEP_ROWS = (128, 256, 576, 656, 1024, 4096)


def shipped_configs(target: str = "sm90") -> list:
    """The configurations the platform ships for ``target`` (across the link, on the device)."""
    from kvtier.platforms import default_config
    platform = "rocm" if target.startswith("gfx") else "cuda"
    out = []
    for c in (default_config(platform), default_config(platform, crosses_link=False)):
        if c not in out:
            out.append(c)
    return out


def default_sweep(target: str = "sm90"):
    """The configurations `kvtier codegen` reports: the shipped defaults and a few
    neighbours (one stage, deeper pipelines), for the row sizes engines use, in all four
    addressing-mode pairs; the link default also with 64-bit row offsets."""
    link = shipped_configs(target)[0]
    configs = shipped_configs(target) + [
        CopyConfig(num_programs=4, rows=64, block_bytes=1024, num_warps=8),
        CopyConfig(num_programs=4, rows=16, block_bytes=2048, num_warps=8, stages=4, tile_bytes=32768),
        CopyConfig(num_programs=4, rows=64, block_bytes=1024, num_warps=4, stages=2)]
    shapes = []
    for row in SWEEP_ROWS:
        for st, dt in ((True, False), (False, True), (False, False), (True, True)):
            shapes.append(dict(row_bytes=row, src_table=st, dst_table=dt))
    seen = set()
    for c in configs:
        if c in seen:
            continue
        seen.add(c)
        for s in shapes:
            yield c, s
            if c == link and s["src_table"] != s["dst_table"]:
                yield c, dict(s, offset_bits=64)


_FILL = {"cuda": _fill_cuda, "hip": _fill_amd}     # what each target's backend reports, by backend


if __name__ == "__main__":     # compile_reports' child: JSON requests in, JSON reports out
    import json as _json
    import sys as _sys
    _todo = _json.load(_sys.stdin)
    _json.dump([_report(q["target"], CopyConfig.from_dict(q["config"]), q["shape"]).to_dict() for q in _todo],
               _sys.stdout)

