"""``scripts/reproduce/compare.py``: the bookkeeping around a bundle's comparison (no evaluation runs here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

COMPARE = Path(__file__).resolve().parents[1] / "scripts" / "reproduce" / "compare.py"


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("compare_script", COMPARE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _report(folder: Path) -> dict:
    """A report folder as a comparison leaves it: eval.json with three columns (one added later), a bench folder."""
    labels = ["dflash", "dmtp", "dmtp-d2"]
    evaluation = {
        "created": "2026-12-03T15:20:33+00:00",
        "strategies": [{"label": label} for label in labels],
        "results": {name: {label: {"hist": [1, 2]} for label in labels} for name in ("gsm8k", "alpaca")},
        "overall": {label: {"hist": [2, 4]} for label in labels},
        "column_baselines": {"dmtp-d2": {"gsm8k": {"wall_seconds": 1.0}}},
    }
    folder.mkdir()
    (folder / "eval.json").write_text(json.dumps(evaluation))
    (folder / "README.md").write_text("# the report as it was\n")
    (folder / "bench-1").mkdir()
    (folder / "bench-1" / "bench.json").write_text("{}")
    return evaluation


def test_replaced_columns_leave_the_report_and_the_old_report_is_kept(compare, tmp_path):
    out = tmp_path / "report"
    before = _report(out)
    history = compare.retire_columns(out, ["dmtp", "dmtp-d2"])
    assert history == out / "history" / "2026-12-03"
    assert json.loads((history / "eval.json").read_text()) == before
    assert (history / "README.md").read_text() == "# the report as it was\n"
    # the bench rows were measured with the replaced models: moved, not left next to the new columns
    assert (history / "bench-1" / "bench.json").is_file() and not (out / "bench-1").exists()
    after = json.loads((out / "eval.json").read_text())
    assert [s["label"] for s in after["strategies"]] == ["dflash"]
    assert all(set(table) == {"dflash"} for table in [*after["results"].values(), after["overall"]])
    assert "column_baselines" not in after  # the only later column was replaced
    assert after["replaced_columns"] == {"labels": ["dmtp", "dmtp-d2"], "history": "history/2026-12-03"}


def test_the_report_says_which_columns_ran_later_and_which_again(compare):
    evaluation = {
        "column_baselines": {"dmtp-d2": {}, "dmtp": {}},
        "replaced_columns": {"labels": ["dmtp"], "history": "history/2026-12-03"},
    }
    note = compare._added_columns(evaluation)
    assert "Column `dmtp-d2` ran later" in note and "--add-strategies dmtp-d2`" in note
    assert "Column `dmtp` ran again" in note and "(history/2026-12-03/README.md)" in note
    assert compare._added_columns({}) == ""


def test_a_history_is_never_overwritten_and_unknown_columns_are_refused(compare, tmp_path):
    out = tmp_path / "report"
    _report(out)
    with pytest.raises(SystemExit, match="mtp9"):
        compare.retire_columns(out, ["mtp9"])
    compare.retire_columns(out, ["dmtp"])
    with pytest.raises(SystemExit, match="exists"):
        compare.retire_columns(out, ["dmtp-d2"])
