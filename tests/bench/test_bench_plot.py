"""The benchmark's plot: one colour per series in every panel, the ceiling in a colour no
series takes, legends in numeric order of program caps; the drawn figure is the spec."""
import pytest
from matplotlib.colors import to_rgba

from kvtier.bench import report

SERIES = [("pool", "kernel", 0), ("pool", "dma", 0), ("copy_rows", "kernel", 32), ("copy_rows", "kernel", 4),
          ("copy_rows", "kernel", 16), ("copy_rows", "kernel", 1), ("copy_rows", "kernel", 2),
          ("torch", "-", 0), ("torch copy_", "-", 0), ("vllm", "-", 0), ("sgl_kernel", "-", 0)]


def _run():
    points = []
    for op in ("backup", "load", "gather"):
        for engine, strategy, cap in SERIES:
            if op == "gather" and (strategy == "dma" or engine in ("vllm", "sgl_kernel")):
                continue
            for n in (1024, 4096):
                points.append({"op": op, "layout": "layer_first", "row_bytes": 1024, "page_size": 64,
                               "tokens": n, "bytes": n * 4096, "engine": engine,
                               "strategy": strategy if op != "gather" or engine != "pool" else "-",
                               "cap": cap, "gbps": 1.0 + cap + n / 1024})
    return {"points": points, "ceilings": {"h2d": 55.0, "d2h": 54.0, "d2d": 2000.0},
            "environment": {"device": "test", "hardware_figures": True}}


def test_legend_in_numeric_order_and_one_colour_per_series():
    spec = report.plot_spec(_run())
    assert [p["op"] for p in spec["panels"]] == ["backup", "load", "gather"]
    labels = [line["label"] for line in spec["panels"][0]["lines"]]
    assert labels == ["kvtier pool kernel", "kvtier pool dma", "kvtier copy_rows p<=1", "kvtier copy_rows p<=2",
                      "kvtier copy_rows p<=4", "kvtier copy_rows p<=16", "kvtier copy_rows p<=32", "torch",
                      "torch copy_", "sgl_kernel", "vllm"]
    colours = {}
    for panel in spec["panels"]:
        for line in panel["lines"]:
            assert colours.setdefault(line["label"], line["color"]) == line["color"]
    caps = [c for name, c in colours.items() if "copy_rows" in name]
    assert len(set(caps)) == len(caps)
    link = [c for name, c in colours.items() if name != "kvtier pool"]
    assert len(set(link)) == len(link)
    for panel in spec["panels"]:
        assert panel["ceiling"]["color"] not in colours.values() and panel["ceiling"]["linestyle"] == "--"
    assert spec["panels"][0]["ceiling"]["y"] == 54.0 and spec["panels"][2]["ceiling"]["y"] == 2000.0


def test_drawn_figure_follows_the_spec():
    spec = report.plot_spec(_run())
    fig = report.draw(spec)
    for ax, panel in zip(fig.axes, spec["panels"]):
        texts = [t.get_text() for t in ax.get_legend().get_texts()]
        assert texts == [line["label"] for line in panel["lines"]] + [panel["ceiling"]["label"]]
        drawn = ax.get_lines()
        for line, artist in zip(panel["lines"], drawn):
            assert to_rgba(artist.get_color()) == to_rgba(line["color"])
        assert to_rgba(drawn[-1].get_color()) == to_rgba(panel["ceiling"]["color"])


@pytest.mark.parametrize("name, key", [("kvtier copy_rows p<=8", (1, 8)), ("kvtier pool dma", (0, 1)),
                                       ("vllm", (7, 0))])
def test_series_key(name, key):
    assert report.series_key(name)[:2] == key
