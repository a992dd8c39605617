"""docs/benchmarks.md shows each benchmark's table as its committed JSON report gives it, never a stale copy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "tables.py"
DOC = ROOT / "docs" / "benchmarks.md"


def tables(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, check=False)


def test_the_docs_tables_are_the_ones_the_reports_give():
    done = tables("--check")
    assert done.returncode == 0, done.stderr


def test_every_benchmark_with_a_report_has_its_table_on_the_page():
    text = DOC.read_text()
    for name in ("engine", "engine_sampling", "gps", "shift", "train_memory", "moe", "modes", "semantics", "soak",
                 "fidelity", "paper", "gap", "reach", "estimate", "layouts", "sim_scale", "tensor_parallel",
                 "staleness"):  # fmt: skip
        assert f"<!-- table:{name} -->" in text and f"<!-- /table:{name} -->" in text, name


def test_a_number_changed_by_hand_is_found_and_rewritten(tmp_path):
    text = DOC.read_text()
    start = text.index("<!-- table:semantics -->")
    row = text.index("| shiftable | 4 |", start)
    edited = text[:row] + text[row:].replace("| shiftable | 4 |", "| shiftable | 5 |", 1)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(edited)
    stale = tables("--check", "--doc", str(doc))
    assert stale.returncode == 1 and "semantics" in stale.stderr
    assert tables("--doc", str(doc)).returncode == 0
    assert doc.read_text() == text


def test_prose_outside_the_markers_is_left_alone(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("before\n<!-- table:soak -->\nold\n<!-- /table:soak -->\nafter\n")
    assert tables("--doc", str(doc)).returncode == 0
    out = doc.read_text()
    assert out.startswith("before\n<!-- table:soak -->\n| steps |") and out.endswith("<!-- /table:soak -->\nafter\n")
    assert "old" not in out


def test_an_unknown_table_name_fails_loudly(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("<!-- table:nosuch -->\n<!-- /table:nosuch -->\n")
    done = tables("--check", "--doc", str(doc))
    assert done.returncode != 0 and "nosuch" in done.stderr
