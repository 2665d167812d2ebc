"""Every command answers a bad flag, environment variable or output path with exit status 2
and one line on stderr naming it, never a traceback, and before any work starts.

A few cases run as a user would (a fresh `python -m kvtier`); the rest run in-process with
every long-running entry point replaced by `started` (a benchmark's sweep, the overhead and
interference runs, the tuner, the compiler, the demo's first allocation), so a refusal that
came after the work began fails the test. `test_good_flags_reach_the_work` shows those
replacements are where the work begins.

Read-only places without chmod (root ignores permission bits): /proc (nothing can be
created there) and /sys/kernel (a directory root may "access" for writing, where creating
a file fails), plus paths under a regular file.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench_support import bench  # noqa: F401  (kvtier.bench importable in this process)
from kvtier.cli.main import main

SUBPROCESS_CASES = [      # one per command; the other flags' refusals run in-process (CASES)
    (["demo", "--layers", "x"], "--layers"),
    (["codegen", "--target", "sm999"], "--target"),
    (["autotune", "--platform", "npu"], "--platform='npu'"),
    (["bench", "--rows", "0"], "--rows='0'"),
    (["nonsense"], "nonsense"),
]


@pytest.mark.parametrize("argv,flag", SUBPROCESS_CASES, ids=[" ".join(c[0]) for c in SUBPROCESS_CASES])
def test_bad_flag_exits_2_with_one_line(argv, flag):
    env = dict(os.environ, KVTIER_PLATFORM="cpu")
    r = subprocess.run([sys.executable, "-m", "kvtier", *argv], capture_output=True, text=True,
                       timeout=120, env=env)
    lines = [l for l in r.stderr.splitlines() if l.strip() and "Warning" not in l and "warn_once" not in l]
    assert r.returncode == 2, (r.returncode, r.stderr[-800:])
    assert "Traceback" not in r.stderr
    assert len(lines) == 1 and flag in lines[0], lines


class WorkStarted(Exception):
    """Raised where a command's work begins, in place of that work."""


def started(*args, **kwargs):
    raise WorkStarted


@pytest.fixture
def no_work(monkeypatch, tmp_path):
    """The commands' long-running entry points raise `WorkStarted`; the autotune cache and
    the working directory are fresh temporary ones, the platform the CPU."""
    import kvtier.autotune.search as search
    import kvtier.bench.interference as interference
    import kvtier.bench.overhead as overhead
    import kvtier.kernels.codegen as codegen
    from kvtier.autotune import select
    monkeypatch.setattr(bench, "run_sweep", started)
    monkeypatch.setattr(overhead, "measure_overhead", started)
    monkeypatch.setattr(interference, "measure", started)
    monkeypatch.setattr(search, "tune", started)
    monkeypatch.setattr(codegen, "compile_report", started)
    monkeypatch.setattr(torch, "randn", started)            # the demo's first buffer
    monkeypatch.setenv("KVTIER_PLATFORM", "cpu")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("KVTIER_DMA_COPY", "KVTIER_DMA_CHUNK_BYTES", "KVTIER_MAX_PROGRAMS"):
        monkeypatch.delenv(var, raising=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    select.invalidate()
    yield tmp_path
    select.invalidate()


def _places(tmp: Path) -> dict:
    """{name: path} for the bad places the cases name: a regular file, a path under it, a
    place nothing can be created in, a directory that refuses new files to root too."""
    f = tmp / "afile"
    f.write_text("kept")
    return {"{file}": str(f), "{under}": str(f / "sub"), "{dir}": str(tmp), "{missing}": str(tmp / "no" / "o.json")}


def _expand(items, places):
    out = []
    for item in items:
        for k, v in places.items():
            item = item.replace(k, v)
        out.append(item)
    return out


def _run(argv):
    try:
        return main(argv)
    except SystemExit as e:      # argparse's own refusals
        return e.code


TINY = ["autotune", "--layers", "2", "--heads", "1", "--head-dim", "8", "--page-size", "2", "--rows", "4",
        "--ops", "backup"]
MLA = ["autotune", "--layers", "2", "--page-size", "2", "--rows", "4", "--ops", "backup", "--mla"]
HUGE = "99999999999"
RO_DIR = "/sys/kernel"
linux_only = pytest.mark.skipif(not Path(RO_DIR).is_dir() or not Path("/proc/self").is_dir(),
                                reason="needs Linux's /proc and /sys")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")

# (argv, environment, start of the one stderr line). Paths: see `_places`.
CASES = [
    # kvtier bench: sizes, lists, numbers
    *[(["bench", flag, v], {}, f"{flag}={v!r}") for flag in ("--rows", "--pages", "--tokens", "--caps")
      for v in ("0", "-1", "", ",", "1,,2", "1.5")],
    (["bench", "--layouts", "diagonal"], {}, "--layouts='diagonal'"),
    (["bench", "--layouts", ""], {}, "--layouts=''"),
    (["bench", "--strategies", "copy"], {}, "--strategies='copy'"),
    (["bench", "--ops", ""], {}, "--ops=''"),
    (["bench", "--ops", "swap"], {}, "--ops"),
    (["nonsense"], {}, "nonsense"),
    (["bench", "--pages", "64", "--tokens", "32"], {}, "--pages=64 --tokens=32: no point to measure"),
    (["bench", "--layouts", "page_head", "--rows", "656"], {}, "--layouts=page_head --rows=656: no point"),
    (["bench", "--rows", HUGE], {}, f"--rows={HUGE}: needs"),
    (["bench", "--tokens", "16" + "0" * 12, "--pages", "16"], {}, "--pages=16 --tokens=16"),
    (["bench", "--iters", "-3"], {}, "--iters='-3'"),
    (["bench", "--time-budget", "nan"], {}, "--time-budget='nan'"),
    (["bench", "--interference", "--smoke", "--caps", ""], {}, "--caps=''"),
    # kvtier bench: output paths
    (["bench", "--out", ""], {}, "--out=''"),
    (["bench", "--out", "{file}"], {}, "--out='{file}': exists and is not a directory"),
    (["bench", "--out", "{under}"], {}, "--out='{under}': cannot be created"),
    (["bench", "--interference", "--smoke", "--out", "{file}"], {}, "--out='{file}'"),
    (["bench", "--json", ""], {}, "--json=''"),
    (["bench", "--json", "{dir}"], {}, "--json='{dir}': is a directory"),
    (["bench", "--json", "{under}"], {}, "--json='{under}': directory '{file}' is not a directory"),
    (["bench", "--overhead", "--json", "{missing}"], {}, "--json='{missing}': directory"),
    pytest.param(["bench", "--out", "/proc/kvtier-out"], {}, "--out='/proc/kvtier-out': cannot be created",
                 marks=linux_only),
    pytest.param(["bench", "--out", RO_DIR], {}, f"--out='{RO_DIR}': cannot be written", marks=linux_only),
    pytest.param(["bench", "--json", "/proc/kvtier.json"], {}, "--json='/proc/kvtier.json': cannot be written",
                 marks=linux_only),
    pytest.param(["bench", "--overhead", "--json", RO_DIR + "/o.json"], {}, "cannot be written", marks=linux_only),
    pytest.param(["bench", "--json", "/proc/version"], {}, "--json='/proc/version': cannot be written",
                 marks=linux_only),
    # kvtier codegen: --json before compiling
    (["codegen", "--json", "{dir}"], {}, "--json='{dir}': is a directory"),
    (["codegen", "--json", "{under}"], {}, "--json='{under}'"),
    (["codegen", "--json", ""], {}, "--json=''"),
    pytest.param(["codegen", "--json", "/proc/kvtier.json"], {}, "--json='/proc/kvtier.json'", marks=linux_only),
    # kvtier demo: flags, sizes past this machine's memory
    (["demo", "--pages", "0"], {}, "--pages"),
    (["demo", "--layout", "sideways"], {}, "--layout"),
    (["demo", "--pages", "4", "--moved-pages", "9"], {}, "--moved-pages"),
    (["demo", "--pages", HUGE], {}, f"--layers=4 --pages={HUGE} --page-size=16 --heads=4 --head-dim=64: needs"),
    (["demo", "--layers", HUGE], {}, f"--layers={HUGE}"),
    (["demo", "--head-dim", HUGE], {}, f"--head-dim={HUGE}: needs"),
    # kvtier autotune: shapes, lists, conflicts
    (["autotune", "--layers", "0"], {}, "--layers"),
    (["autotune", "--top", "-1"], {}, "--top"),
    (["autotune", "--platform", "tpu"], {}, "--platform"),
    (["autotune", "--ops", ","], {}, "--ops"),
    (MLA + [""], {}, "--mla=''"),
    (MLA + ["0,64"], {}, "--mla='0,64'"),
    (MLA + ["512"], {}, "--mla='512': must be kv_lora_rank,qk_rope_head_dim"),
    (MLA + ["1,2,3"], {}, "--mla='1,2,3': must be kv_lora_rank,qk_rope_head_dim"),
    (MLA + [f"{HUGE},64"], {}, f"--layers=2 --mla={HUGE},64"),
    (TINY + ["--mla", "16,8"], {}, "--heads: an MLA row is --mla's"),
    (MLA + ["16,8", "--head-dim", "8"], {}, "--head-dim: an MLA row is --mla's"),
    (TINY + ["--rows", ""], {}, "--rows=''"),
    (TINY + ["--transfer-layers", ""], {}, "--transfer-layers=''"),
    (TINY + ["--transfer-layers", "3"], {}, "--transfer-layers='3': at most --layers=2"),
    (TINY + ["--transfer-layers", HUGE], {}, f"--transfer-layers='{HUGE}'"),
    (TINY + ["--dtype", ""], {}, "--dtype=''"),
    (TINY + ["--codegen-target", "sm999"], {}, "argument --codegen-target"),
    (TINY + ["--host-layout", "diagonal"], {}, "argument --host-layout"),
    (TINY + ["--layers", HUGE], {}, f"--layers={HUGE} --heads=1 --head-dim=8 --page-size=2"),
    (TINY + ["--rows", HUGE], {}, f"--rows={HUGE}"),
    (["autotune", "--show", "--layers", "3"], {}, "--layers: --show prints the cache and takes no other flag"),
    (["autotune", "--show", "--platform", "cpu"], {}, "--platform: --show"),
    (TINY + ["--platform", "rocm"], {}, "--platform='rocm': no rocm device here"),
    (TINY + ["--platform", "npu"], {}, "--platform='npu': no npu device here"),
    pytest.param(TINY + ["--platform", "cuda"], {}, "--platform='cuda': no cuda device here", marks=no_cuda),
    # kvtier autotune: the cache directory
    (TINY, {"KVTIER_CACHE_DIR": "{file}"}, "KVTIER_CACHE_DIR='{file}': exists and is not a directory"),
    (TINY, {"KVTIER_CACHE_DIR": "{under}"}, "KVTIER_CACHE_DIR='{under}': cannot be created"),
    (TINY, {"KVTIER_CACHE_DIR": "", "XDG_CACHE_HOME": "{file}"}, "XDG_CACHE_HOME/kvtier='{file}/kvtier'"),
    (["autotune", "--show"], {"KVTIER_CACHE_DIR": "{file}"}, "KVTIER_CACHE_DIR='{file}': not a directory"),
    pytest.param(TINY, {"KVTIER_CACHE_DIR": "/proc/kvtier"}, "KVTIER_CACHE_DIR='/proc/kvtier': cannot be created",
                 marks=linux_only),
    pytest.param(TINY, {"KVTIER_CACHE_DIR": RO_DIR}, f"KVTIER_CACHE_DIR='{RO_DIR}': cannot be written",
                 marks=linux_only),
    # the environment every command reads
    *[([*argv], {"KVTIER_PLATFORM": p}, f"KVTIER_PLATFORM={p!r}") for p in ("tpu", "rocm", "npu")
      for argv in (["info"], ["demo"], ["bench", "--overhead"], TINY)],
    pytest.param(["bench"], {"KVTIER_PLATFORM": "cuda"}, "KVTIER_PLATFORM='cuda': no cuda device here", marks=no_cuda),
    pytest.param(["demo"], {"KVTIER_PLATFORM": "cuda"}, "KVTIER_PLATFORM='cuda'", marks=no_cuda),
    (["info"], {"KVTIER_DMA_COPY": "fast"}, "KVTIER_DMA_COPY='fast'"),
    (["bench", "--overhead"], {"KVTIER_DMA_CHUNK_BYTES": "0"}, "KVTIER_DMA_CHUNK_BYTES='0'"),
    (TINY, {"KVTIER_DMA_CHUNK_BYTES": "1MiB"}, "KVTIER_DMA_CHUNK_BYTES='1MiB'"),
    (TINY, {"KVTIER_MAX_PROGRAMS": "many"}, "KVTIER_MAX_PROGRAMS='many'"),
    (TINY, {"KVTIER_MAX_PROGRAMS": "0"}, "KVTIER_MAX_PROGRAMS='0'"),
    (TINY, {"KVTIER_MAX_PROGRAMS": "-4"}, "KVTIER_MAX_PROGRAMS='-4'"),
]


def _id(case) -> str:
    values = case.values if hasattr(case, "values") else case
    argv, env, _ = values
    return " ".join([*(f"{k}={v}" for k, v in env.items()), *(a or "''" for a in argv)])


@pytest.mark.parametrize("argv, env, start", CASES, ids=[_id(c) for c in CASES])
def test_refused_in_one_line_before_any_work(argv, env, start, no_work, capsys, monkeypatch):
    places = _places(no_work)
    for k, v in env.items():
        monkeypatch.setenv(k, _expand([v], places)[0])
    rc = _run(_expand(argv, places))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, (rc, out[-500:], err[-500:])
    assert len(lines) == 1 and _expand([start], places)[0] in lines[0], err
    assert not out                                            # nothing started, nothing announced
    assert list((no_work / "work").iterdir()) == []           # no default output directory either
    assert (no_work / "afile").read_text() == "kept"


@pytest.mark.parametrize("argv, env", [
    (["bench", "--rows", "256", "--out", "{dir}/o"], {}),
    (["bench", "--overhead", "--json", "{dir}/o.json"], {}),
    (["bench", "--interference", "--smoke", "--caps", "1", "--out", "{dir}/o"], {}),
    (["codegen", "--json", "{dir}/o.json"], {}),
    (["demo"], {}),
    (TINY, {}),
    (TINY + ["--no-write"], {"KVTIER_CACHE_DIR": "{file}"}),    # --no-write needs no cache directory
    (TINY, {"KVTIER_DMA_CHUNK_BYTES": "4096", "KVTIER_MAX_PROGRAMS": "2", "KVTIER_DMA_COPY": "auto"}),
])
def test_good_flags_reach_the_work(argv, env, no_work, monkeypatch):
    places = _places(no_work)
    for k, v in env.items():
        monkeypatch.setenv(k, _expand([v], places)[0])
    with pytest.raises(WorkStarted):
        main(_expand(argv, places))


def test_memory_check_reads_the_device_and_the_host(monkeypatch):
    """`check_fits` on an accelerator compares device bytes with the device's memory and
    host bytes with the host's (a CUDA device object needs no GPU to be made)."""
    import kvtier.platforms as platforms
    from kvtier.cli import args
    monkeypatch.setattr(platforms, "device_properties", lambda device: {"memory_bytes": 1 << 30})
    gpu, host = torch.device("cuda", 0), args._host_memory()
    args.check_fits("--x=1", gpu, 1 << 30, host)                       # both just fit
    with pytest.raises(args.UsageError, match=r"^--x=1: needs 2\.0 GiB of cuda memory; this machine has 1\.0 GiB$"):
        args.check_fits("--x=1", gpu, 2 << 30, 0)
    with pytest.raises(args.UsageError, match="of host memory"):
        args.check_fits("--x=1", gpu, 0, host + 1)
    with pytest.raises(args.UsageError, match="of host memory"):       # CPU: both sides in host memory
        args.check_fits("--x=1", torch.device("cpu"), host // 2 + 1, host // 2 + 1)
