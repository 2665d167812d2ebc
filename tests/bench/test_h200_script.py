"""bench/h200.sh, the one prepared hardware run: valid bash, every step of the measurement
in order under one deadline, the overhead step kept, the README written last."""
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "h200.sh"


def test_script_parses_and_runs_every_step_in_order():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    steps = re.findall(r"^\s*step ([\w-]+) ", text, flags=re.M)
    assert steps == ["env", "cuda-tests", "overhead", "binding", "bench", "interference", "bench-layouts", "readme"]
    assert "bench --overhead --json" in text.replace("\\\n  ", "")
    assert "--interference --out" in text.replace("\\\n  ", "")
    assert "KVTIER_TOTAL_BUDGET:-470" in text and "results/$(date -u +%F)_" in text
    assert "kvtier.bench.results_readme" in text
