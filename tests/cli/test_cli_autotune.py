"""`kvtier autotune` in-process on CPU: a tiny shape under the interpreter completes,
prints the table and writes a cache that `--show` prints and pools read."""
import io
import json

import pytest

from kvtier.autotune import select_config
from kvtier.autotune.cache import cache_path
from kvtier.autotune.key import device_identity
from kvtier.cli.autotune_cmd import ProgressBar
from kvtier.cli.main import main

TINY = ["autotune", "--layers", "2", "--heads", "1", "--head-dim", "8", "--dtype", "float16",
        "--page-size", "2", "--rows", "4"]

pytestmark = pytest.mark.usefixtures("tmp_cache")


def test_autotune_smoke_writes_a_cache_that_show_prints_and_pools_read(capsys):
    assert main(TINY + ["--ops", "backup,gather"]) == 0
    out, err = capsys.readouterr()
    assert "GB/s" in out and "% best" in out and "100.0%" in out and "*" in out
    assert "backup (across the link) rows=4" in out and "gather (on device) rows=4" in out
    assert "4/4" in err or "/" in err                       # the progress bar ran
    path = cache_path(device_identity("cpu"))
    assert f"written: {path}" in out
    doc = json.loads(path.read_text())
    assert sorted(doc["entries"]) == ["backup|link=1|row=16|page=2|rows=4|layers=2",
                                      "gather|link=0|row=16|page=2|rows=4|layers=2"]
    best = doc["entries"]["backup|link=1|row=16|page=2|rows=4|layers=2"]["config"]
    assert select_config("backup", "cpu", row_bytes=16, page_size=2, num_rows=3, num_layers=2,
                         crosses_link=True).to_dict() == best

    assert main(["autotune", "--show"]) == 0
    shown = capsys.readouterr().out
    assert f"{path}: 2 entries" in shown and "backup|link=1|row=16|page=2|rows=4|layers=2" in shown


def test_mla_host_layout_and_no_write(capsys):
    assert main(["autotune", "--layers", "1", "--mla", "16,8", "--page-size", "2", "--rows", "2",
                 "--ops", "load", "--host-layout", "page_first", "--device-layout", "stacked",
                 "--no-write", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "MLA L=1 row=(1, 24)" in out and "more" in out
    assert not cache_path(device_identity("cpu")).exists()


def test_show_with_no_cache(capsys, tmp_cache):
    assert main(["autotune", "--show"]) == 0
    assert "no autotune results" in capsys.readouterr().out


def test_show_survives_a_corrupt_file(capsys, tmp_cache):
    (tmp_cache / "autotune-cpu-x.json").write_text("{oops")
    assert main(["autotune", "--show"]) == 0
    assert "unreadable" in capsys.readouterr().out


@pytest.mark.parametrize("args,msg", [
    (["--ops", "backup,swap"], "ops='swap'"),
    (["--rows", "0"], "--rows='0'"),
    (["--rows", "a,b"], "--rows='a,b'"),
    (["--dtype", "float99"], "--dtype='float99'"),
    (["--mla", "16,8"], "--heads: an MLA row is --mla's"),   # --mla 512: test_cli_bad_flags.py
    (["--host-layout", "diagonal"], "--host-layout"),
])
def test_bad_arguments_exit_2_and_write_nothing(capsys, tmp_cache, args, msg):
    try:
        rc = main(TINY + args)
    except SystemExit as e:          # argparse's own refusal (choices)
        rc = e.code
    assert rc == 2
    assert msg in capsys.readouterr().err
    assert list(tmp_cache.iterdir()) == []


def test_progress_bar_plain_text():
    s = io.StringIO()
    bar = ProgressBar(s, width=10)
    for i in range(1, 21):
        bar(i, 20, f"cfg{i}")
    bar.close()
    lines = s.getvalue().splitlines()
    assert lines[-1].startswith("[##########] 20/20") and lines[-1].endswith("cfg20")
    assert 10 <= len(lines) <= 11                                 # one line per tenth off a terminal
