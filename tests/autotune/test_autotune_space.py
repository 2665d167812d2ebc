"""The search space: program cap, clamping duplicates away, tile limits, strategies."""
import pytest

from autotune_support import logs_warning

from kvtier.kernels import CopyConfig, default_config

from kvtier.autotune.key import DeviceId
from kvtier.autotune.space import (MAX_PROGRAMS_ENV, candidates, default_max_programs, program_counts,
                                   space_for)

H200 = DeviceId("cuda", "NVIDIA H200", "sm_90", 132)
MI300 = DeviceId("rocm", "AMD Instinct MI300X", "gfx942", 304)
NPU = DeviceId("npu", "Ascend910B4", "Ascend910B4", 40, 192 * 1024)
CPU = DeviceId("cpu", "x86_64", "x86_64", 2)


@pytest.fixture(autouse=True)
def _no_env_cap(monkeypatch):
    monkeypatch.delenv(MAX_PROGRAMS_ENV, raising=False)


def test_program_counts():
    assert program_counts(1) == [1]
    assert program_counts(16) == [1, 2, 4, 8, 16]
    assert program_counts(40) == [1, 2, 4, 8, 16, 32, 40]


def test_default_cap_per_device_and_user_override(monkeypatch):
    assert default_max_programs(H200, crosses_link=True) == 16        # an eighth of 132 SMs
    assert default_max_programs(H200, crosses_link=False) == 16 * 132    # the device-copy default's 16 per SM
    assert default_max_programs(DeviceId("cuda", "small", "sm_80", 8), True) == 2
    assert default_max_programs(NPU, True) == 40                      # one per vector core
    monkeypatch.setenv(MAX_PROGRAMS_ENV, "6")
    assert default_max_programs(H200, crosses_link=True) == 6


@pytest.mark.parametrize("device", [H200, MI300])
@pytest.mark.parametrize("chunk", [64, 656, 4096])
def test_gpu_candidates_respect_cap_clamp_and_tile_limit(device, chunk):
    cfgs = candidates(device, chunk_bytes=chunk, crosses_link=True, max_programs=12)
    space = space_for(device)
    assert len(cfgs) == len(set(cfgs)) > 0
    assert {c.num_programs for c in cfgs} == {1, 2, 4, 8, 12}
    assert {c.strategy for c in cfgs} == {"kernel", "dma"}
    widest = 1 << (chunk.bit_length() - 1)
    default = default_config(device.platform)
    kernel = [c for c in cfgs if c.strategy == "kernel"]
    # the shipped default (within the cap, block clamped to the row) is always timed
    assert kernel[0] == CopyConfig(num_programs=min(default.num_programs, 12), rows=default.rows,
                                   block_bytes=min(default.block_bytes, widest), num_warps=default.num_warps,
                                   stages=default.stages, tile_bytes=default.tile_bytes)
    kernel = kernel[1:]
    assert max(c.block_bytes for c in kernel) == min(4096, widest)   # clamped like the launcher
    tile = lambda c: max(c.rows * c.block_bytes, c.tile_bytes)
    assert all(tile(c) <= space.tile_limit for c in kernel)
    # more warps than the tile feeds 16 bytes each are dropped, the fewest warps stay
    assert all(c.num_warps == 1 or tile(c) >= c.num_warps * space.warp * 16 for c in kernel)
    assert any(c.num_warps == 1 for c in kernel)
    # 16 warps only where some tile feeds them: 64 rows x 64 B does not, a tile of
    # 64 KiB (sized in bytes) does
    assert any(c.num_warps == 16 and not c.tile_bytes for c in kernel) == (chunk >= 656)
    assert any(c.num_warps == 16 and c.tile_bytes == 65536 for c in kernel)


def test_device_local_copies_time_kernels_only():
    cfgs = candidates(H200, chunk_bytes=1024, crosses_link=False)
    assert {c.strategy for c in cfgs} == {"kernel"}
    assert max(c.num_programs for c in cfgs) == 16 * 132
    assert default_config("cuda", crosses_link=False) in cfgs


def test_npu_space_has_no_warps_dma_across_the_link_and_fits_the_unified_buffer():
    across = candidates(NPU, chunk_bytes=65536, crosses_link=True)
    # both ways across: kernels reach registered host memory, which the tuner registers as pools can
    assert {c.strategy for c in across} == {"kernel", "dma"}
    local = candidates(NPU, chunk_bytes=65536, crosses_link=False)
    assert {c.num_warps for c in local} == {1}
    assert max(c.num_programs for c in local) == 40
    assert all(c.rows * c.block_bytes <= 96 * 1024 for c in local)
    assert any(c.rows * c.block_bytes == 65536 for c in local)


@pytest.mark.parametrize("device", [H200, MI300, NPU, CPU])
@pytest.mark.parametrize("crosses_link", [True, False])
@pytest.mark.parametrize("quick", [False, True])
def test_every_shipped_default_is_a_candidate(device, crosses_link, quick):
    default = default_config(device.platform, crosses_link)
    assert default in candidates(device, chunk_bytes=default.block_bytes, crosses_link=crosses_link, quick=quick)


def test_quick_space_is_smaller():
    assert len(candidates(H200, chunk_bytes=1024, crosses_link=True, quick=True)) < \
        len(candidates(H200, chunk_bytes=1024, crosses_link=True)) / 3


def test_cpu_space_is_tiny():
    cfgs = candidates(CPU, chunk_bytes=64, crosses_link=True)
    assert 0 < len(cfgs) <= 8


@pytest.mark.parametrize("device", [H200, MI300])
def test_gpu_space_searches_stages_and_tile_bytes_within_shared_memory(device):
    space = space_for(device)
    cfgs = [c for c in candidates(device, chunk_bytes=1024, crosses_link=True) if c.strategy == "kernel"]
    assert {c.stages for c in cfgs} == set(space.stages) and max(space.stages) >= 3
    assert {c.tile_bytes for c in cfgs} == set(space.tile_bytes) and 65536 in space.tile_bytes
    # tiles waiting in shared memory (stages - 1 of them) stay within the space's bound
    assert all((c.stages - 1) * max(c.rows * c.block_bytes, c.tile_bytes) <= space.stage_limit for c in cfgs)
    assert any(c.stages == 4 for c in cfgs) and not any(
        c.stages == 4 and c.rows * c.block_bytes == 65536 for c in cfgs)   # 3 x 64 KiB > 160 KiB
    # CUDA's shipped defaults pipeline (cp.async); ROCm's keep one stage (they would spill)
    pipelined = device.platform == "cuda"
    assert (default_config(device.platform).stages > 1) == pipelined
    assert (default_config(device.platform, False).stages > 1) == pipelined


def test_npu_and_cpu_search_one_stage():
    for device in (NPU, CPU):
        assert {c.stages for c in candidates(device, chunk_bytes=1024, crosses_link=True)} == {1}


def test_configs_written_before_stages_and_tile_bytes_still_load(tmp_path, monkeypatch, caplog):
    """A cache entry without the pipelining fields reads as the kernel it was measured
    with (one stage, tiles of ``rows`` rows); a bad value in them is a malformed entry."""
    import json
    from kvtier.autotune.cache import CACHE_ENV, cache_path, load, store
    from kvtier.autotune.key import TuneKey
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    old = CopyConfig(num_programs=8, rows=4, block_bytes=2048, num_warps=8)
    new = CopyConfig(num_programs=8, rows=4, block_bytes=2048, num_warps=8, stages=3, tile_bytes=65536)
    k = [TuneKey.of("backup", row_bytes=1024, page_size=16, num_rows=n, num_layers=32, crosses_link=True)
         for n in (256, 512, 1024, 2048)]
    store(H200, {k[0]: {"config": old.to_dict()}, k[1]: {"config": new.to_dict()}})
    doc = json.loads(cache_path(H200).read_text())
    entries = doc["entries"]
    legacy = {f: v for f, v in old.to_dict().items() if f not in ("stages", "tile_bytes")}
    entries[k[0].to_str()]["config"] = legacy
    entries[k[2].to_str()] = dict(entries[k[0].to_str()], config=dict(legacy, stages=0))
    entries[k[3].to_str()] = dict(entries[k[0].to_str()], config=dict(legacy, tile_bytes=3000))
    cache_path(H200).write_text(json.dumps(doc))
    with logs_warning(caplog, "2 malformed entries"):
        assert load(H200) == {k[0]: old, k[1]: new}
    assert CopyConfig.from_dict(new.to_dict()) == new
    with pytest.raises(ValueError):
        CopyConfig.from_dict(dict(legacy, stages=True))
