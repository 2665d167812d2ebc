"""kvtier.platforms: detection, per-backend routing, host memory, and importing
kvtier with torch_npu absent, broken, or (simulated) working.

torch_npu states are simulated in subprocesses with a fake package on PYTHONPATH, so
nothing here touches this process's torch.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvtier import platforms as plat
from kvtier.platforms import PlatformUnavailable, ascend

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_py(code: str, pythonpath=(), env=None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``pythonpath`` first on sys.path."""
    e = {k: v for k, v in os.environ.items()
         if k not in ("TORCH_DEVICE_BACKEND_AUTOLOAD", "KVTIER_PLATFORM", "PYTHONPATH")}
    e["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def fake_torch_npu(root, init_src: str, autoload: bool = True):
    """A torch_npu package under ``root``; with ``autoload`` also the entry point through
    which torch imports it during ``import torch`` (as the real wheel declares)."""
    pkg = root / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(init_src))
    if autoload:
        dist = root / "torch_npu-2.13.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.13.0\n")
        (dist / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    return root


BROKEN = """
raise ImportError("libascendcl.so: cannot open shared object file (simulated: no CANN)")
"""

# A working torch_npu stand-in: registers an "npu" device type and a torch.npu module
# that records calls, the way the real one does through PrivateUse1.
WORKING = """
import types, torch
CALLS = []
torch.utils.rename_privateuse1_backend("npu")
npu = types.ModuleType("torch.npu")
npu.is_available = lambda: True
npu.current_device = lambda: 1
npu.synchronize = lambda d=None: CALLS.append(("synchronize", str(d)))
npu.current_stream = lambda d=None: ("stream", str(d))
npu.get_device_properties = lambda d: types.SimpleNamespace(
    name="Ascend910B1", total_memory=64 << 30, multi_processor_count=24)
torch._register_device_module("npu", npu)
def _autoload():
    pass
"""


# ------------------------------------------------------------------ import safety
def test_import_without_torch_npu_loads_no_backend():
    r = run_py("""
        import sys
        import kvtier.kernels, kvtier.pool, kvtier.autotune, kvtier.cli.main
        from kvtier import platforms as p
        assert "torch_npu" not in sys.modules
        assert p.detect_platform() == "cpu", p.detect_platform()
        ok, why = p.npu_status()
        assert not ok and "not installed" in why, why
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_broken_torch_npu_breaks_plain_torch_import(tmp_path):
    """The simulation is faithful: a broken torch_npu that torch auto-loads makes a bare
    ``import torch`` fail (so the next test proves kvtier's guard, not a lenient fake)."""
    fake_torch_npu(tmp_path, BROKEN)
    r = run_py("import torch", pythonpath=[tmp_path])
    assert r.returncode != 0
    assert "torch_npu" in r.stderr and "TORCH_DEVICE_BACKEND_AUTOLOAD" in r.stderr


def test_broken_torch_npu_kvtier_imports_and_npu_says_why(tmp_path):
    fake_torch_npu(tmp_path, BROKEN)
    r = run_py("""
        import sys
        import kvtier.kernels
        import torch  # after kvtier: autoload is off, torch_npu is not imported
        from kvtier import platforms as p
        assert "torch_npu" not in sys.modules
        assert p.detect_platform() == "cpu"
        ok, why = p.npu_status()
        assert not ok and "libascendcl.so" in why, why
        for call in (lambda: p.default_device("npu"), lambda: p.synchronize("npu"),
                     lambda: p.current_stream("npu:0"), lambda: p.device_properties("npu:0")):
            try:
                call()
            except p.PlatformUnavailable as e:
                assert "libascendcl.so" in str(e) and "npu" in str(e), e
            else:
                raise AssertionError("using the npu platform did not fail")
        info = p.platform_info()
        assert info["platform"] == "cpu" and "libascendcl.so" in info["npu"], info
        print("OK")
    """, pythonpath=[tmp_path])
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_import_leaves_the_environment_as_it_was():
    r = run_py("""
        import os, kvtier.kernels, kvtier.pool, kvtier.cli.main
        assert "TORCH_DEVICE_BACKEND_AUTOLOAD" not in os.environ, os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"]
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_cli_works_with_a_broken_torch_npu(tmp_path):
    """The command imports torch through kvtier's guard first, so `kvtier info` answers."""
    fake_torch_npu(tmp_path, BROKEN)
    r = run_py("""
        import sys
        from kvtier.cli.main import main
        sys.exit(main(["info"]))
    """, pythonpath=[tmp_path])
    assert r.returncode == 0 and "libascendcl.so" in r.stdout, r.stderr


def test_user_autoload_choice_is_kept(tmp_path):
    r = run_py("""
        import os, kvtier.kernels
        print(os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"])
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr


def test_working_torch_npu_routes_to_torch_npu(tmp_path):
    fake_torch_npu(tmp_path, WORKING, autoload=False)
    r = run_py("""
        import sys, torch
        import kvtier.kernels
        from kvtier import platforms as p
        assert "torch_npu" not in sys.modules        # still lazy after import
        assert p.detect_platform() == "npu"
        import torch_npu
        assert p.default_device() == torch.device("npu", 1)
        p.synchronize()
        p.synchronize("npu:0")
        assert torch_npu.CALLS == [("synchronize", "npu:1"), ("synchronize", "npu:0")], torch_npu.CALLS
        assert p.current_stream("npu") == ("stream", "npu:1")
        assert p.stream_key(torch.device("npu", 1)) == ("stream", "npu:1")   # the stream itself
        props = p.device_properties("npu:0")
        assert props["name"] == "Ascend910B1" and props["ub_bytes"] == 256 << 10, props
        lim = p.npu_launch_limits("npu:0")
        assert lim["max_tile_bytes"] == 128 << 10, lim
        info = p.platform_info()
        assert info["platform"] == "npu" and info["npu"] is True and "npu_launch_limits" in info
        print("OK")
    """, pythonpath=[tmp_path])
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


# ------------------------------------------------------------------ in-process helpers
def test_forced_platform(monkeypatch):
    monkeypatch.setenv(plat.ENV_PLATFORM, "rocm")
    assert plat.detect_platform() == "rocm"
    monkeypatch.setenv(plat.ENV_PLATFORM, "tpu")
    with pytest.raises(PlatformUnavailable, match="KVTIER_PLATFORM='tpu'"):
        plat.detect_platform()


def test_cpu_helpers(monkeypatch):
    monkeypatch.setenv(plat.ENV_PLATFORM, "cpu")
    assert plat.default_device() == torch.device("cpu")
    plat.synchronize()
    assert plat.current_stream("cpu") is None and plat.stream_key(torch.device("cpu")) is None
    t = torch.arange(10, dtype=torch.int16)
    assert plat.pin(t) is t and not t.is_pinned()
    e = plat.pinned_empty((3, 5), torch.bfloat16)
    assert e.shape == (3, 5) and e.dtype == torch.bfloat16 and not e.is_pinned()
    props = plat.device_properties("cpu")
    assert props["platform"] == "cpu" and props["compute_units"] >= 1


def test_platform_of():
    assert plat.platform_of("cpu") == "cpu"
    assert plat.platform_of(torch.device("cuda", 0)) in ("cuda", "rocm")
    with pytest.raises(PlatformUnavailable, match="meta"):
        plat.platform_of("meta")


@pytest.mark.parametrize("name,ub,tile", [("Ascend910B4", 192 << 10, 64 << 10),
                                          ("Ascend910B1", 256 << 10, 128 << 10),
                                          ("Ascend910_9391", 192 << 10, 64 << 10)])
def test_npu_launch_limits(name, ub, tile):
    props = {"name": name, "num_aicore": 20, "num_vectorcore": 40,
             "ub_bytes": ascend._NPU_UB_BYTES.get(name, ascend._NPU_UB_DEFAULT)}
    lim = plat.npu_launch_limits(props=props)
    assert lim == {"grid": 40, "max_tile_bytes": tile, "ub_bytes": ub, "min_rows": 2, "min_piece_bytes": 32}
    assert lim["max_tile_bytes"] * 2 <= ub


def test_host_device_address():
    t = torch.empty(64, dtype=torch.uint8)
    view = t[16:]
    assert plat.host_device_address(view, "cpu") == view.data_ptr()
    assert plat.host_device_address(view, "cuda") is None          # not pinned
    assert plat.host_device_address(view, "npu") is None           # not registered
    plat.register_host_memory(t, 0x7000_0000)
    try:
        assert plat.host_device_address(view, "npu") == 0x7000_0000 + 16
    finally:
        ascend._registered.pop(t.untyped_storage().data_ptr())
    with pytest.raises(PlatformUnavailable, match="meta"):
        plat.register_host_memory(torch.empty(4, device="meta"), 1)


def test_both_tritons_installed_is_reported(monkeypatch, caplog):
    """Community Triton and triton-ascend overwrite each other's `triton` module: kvtier info
    and the first kernel launch say so, with what to do."""
    import importlib.metadata as md
    real = md.version
    monkeypatch.setattr(md, "version", lambda d: "3.2.0" if d in ("triton", "triton-ascend") else real(d))
    assert "pip uninstall" in plat.triton_conflict()
    assert plat.platform_info()["warning"] == plat.TRITON_CONFLICT
    import importlib
    launcher = importlib.import_module("kvtier.kernels.launcher")
    monkeypatch.setattr(launcher, "_kernel_loaded", [])
    with caplog.at_level("WARNING", logger="kvtier"):
        launcher._kernel()
    assert any("both installed" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(md, "version", real)
    assert plat.triton_conflict() is None


@pytest.mark.cuda
def test_stream_key_names_the_current_stream_without_a_stream_object():
    dev = torch.device("cuda", torch.cuda.current_device())
    key = plat.stream_key(dev)
    assert key == plat.stream_key(dev) == (dev.index, torch.cuda.current_stream(dev).cuda_stream)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        assert plat.stream_key(dev) == (dev.index, side.cuda_stream) != key
    assert plat.stream_key(dev) == key


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_default_device_of_a_platform_without_a_device_names_it():
    """torch answers with an AssertionError ("Torch not compiled with CUDA enabled"):
    kvtier with a KvtierError naming the platform, and torch's reason."""
    from kvtier.kernels import KvtierError
    with pytest.raises(KvtierError, match=r"platform='cuda': has no device here \(.+\)"):
        plat.default_device("cuda")
