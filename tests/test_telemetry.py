import json

import pytest

from pivotrl.cli import main
from pivotrl.telemetry import RunWriter, Slice, read_events


def slices() -> list[Slice]:
    return [
        Slice(0, "rollout", "rollout step 1", 0.0, 0.5),
        Slice(0, "genrm", "judge step 1", 0.5, 1.25, {"tokens": 120}),
        Slice(1, "train", "train step 1", 1.25, 2.0),
    ]


def test_trace_is_chrome_trace_event_json(tmp_path):
    RunWriter(tmp_path).write_events(slices(), title="t")
    trace = json.loads((tmp_path / "trace.json").read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 3
    judge = next(e for e in complete if e["cat"] == "genrm")
    assert (judge["ts"], judge["dur"], judge["tid"]) == (500000.0, 750000.0, 0)
    assert judge["args"] == {"role": "genrm", "tokens": 120}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {"device 0", "device 1"}


def test_events_round_trip_and_timeline_redraw(tmp_path, capsys):
    RunWriter(tmp_path).write_events(slices())
    assert read_events(tmp_path) == slices()
    png = tmp_path / "timeline.png"
    png.unlink()
    assert main(["timeline", str(tmp_path)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_of_a_directory_without_events_is_a_user_error(tmp_path, capsys):
    assert main(["timeline", str(tmp_path)]) == 2
    assert "no events.jsonl" in capsys.readouterr().err


def test_read_events_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_events(tmp_path)
