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


def _reports(monkeypatch, fails):
    """`kvtier codegen` over a short sweep whose compiles fail where ``fails(i)`` says."""
    import kvtier.kernels.codegen as codegen
    sweep = list(codegen.default_sweep("sm90"))[:4]
    monkeypatch.setattr(codegen, "default_sweep", lambda target: sweep)
    import inspect
    defaults = {k: p.default for k, p in inspect.signature(codegen.compile_report).parameters.items()
                if p.kind is p.KEYWORD_ONLY and k != "config"}
    calls = []

    def report(target, config=None, **shape):
        i = len(calls)
        calls.append(i)
        r = codegen.KernelReport(target=target, config=config.to_dict(), shape=dict(defaults, **shape))
        if fails(i):
            r.error = "RuntimeError: no cuda backend here"
        return r
    monkeypatch.setattr(codegen, "compile_report", report)


def test_codegen_where_nothing_compiles_says_why_in_one_line(monkeypatch, capsys):
    _reports(monkeypatch, lambda i: True)
    assert main(["codegen", "--target", "sm90"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2, out          # the header and one line saying why
    assert "no configuration compiles for --target sm90 here (4 tried)" in out[1]
    assert "no cuda backend here" in out[1]


def test_codegen_prints_every_failure_once_something_compiled(monkeypatch, capsys):
    _reports(monkeypatch, lambda i: i in (0, 2))
    assert main(["codegen", "--target", "sm90"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert sum("ERROR" in line for line in out) == 2 and len(out) == 6
    assert out[-1].startswith("4 configurations, 2 failed to compile")
