"""The kvtier command: info, demo and codegen run in-process."""
import pytest

from kvtier.cli.main import main


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "platform" in out and "interpreter" in out
    assert "dma_copies: torch copies" in out
    assert "device.compute_units:" in out and "{" not in out       # nested facts, one per line
    lines = [l for l in out.splitlines() if ": " in l]
    assert len({l.index(": ") for l in lines}) == 1                 # one column


def test_info_json(capsys):
    import json
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["platform"] == "cpu" and info["device"]["compute_units"] >= 1


def test_dma_copy_description(monkeypatch):
    from kvtier.platforms import cuda as cuda_platform
    from kvtier.pool import link_copy
    monkeypatch.setenv("TASK_QUEUE_ENABLE", "1")
    assert "TASK_QUEUE_ENABLE=0" in link_copy.describe("npu")
    fake = link_copy.Runtime("cuda", None, None, 1, 1, batch=lambda *a: 0)
    monkeypatch.setattr(cuda_platform, "_runtime", lambda hip: fake)
    assert link_copy.describe("cuda") == "cuda 2-D copies + batch for short copies (KVTIER_DMA_COPY=auto)"
    monkeypatch.setenv("KVTIER_DMA_COPY", "2d")
    assert link_copy.describe("cuda") == "cuda 2-D copies (KVTIER_DMA_COPY=2d)"
    monkeypatch.setattr(cuda_platform, "_runtime", lambda hip: None)
    assert "not found" in link_copy.describe("cuda")


def test_demo_checks_every_byte(capsys):
    assert main(["demo", "--layers", "2", "--pages", "8", "--page-size", "4", "--heads", "2",
                 "--head-dim", "16", "--moved-pages", "3"]) == 0
    out = capsys.readouterr().out
    assert "every byte checked: OK" in out and ("GB/s" in out or "MB/s" in out)
    assert "not a device's figures" in out          # CPU runs say what their times are


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_head"])
def test_demo_layouts(layout, capsys):
    assert main(["demo", "--layers", "2", "--pages", "4", "--page-size", "2", "--heads", "2",
                 "--head-dim", "8", "--moved-pages", "2", "--layout", layout]) == 0
    assert "OK" in capsys.readouterr().out


def test_codegen_unknown_target(capsys):
    pytest.importorskip("triton")
    with pytest.raises(SystemExit) as e:
        main(["codegen", "--target", "nope"])
    assert e.value.code == 2
    assert "--target" in capsys.readouterr().err
