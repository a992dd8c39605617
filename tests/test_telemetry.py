import json

import pytest

from pivotrl.cli import main
from pivotrl.telemetry import (
    RASTER_COLUMNS,
    ROLE_COLORS,
    STEPS_PID,
    RunWriter,
    Slice,
    _raster,
    draw_timeline,
    jsonl,
    read_events,
    step_spans,
    write_trace,
)


def slices() -> list[Slice]:
    return [
        Slice(0, "rollout", "rollout step 1", 0.0, 0.5),
        Slice(0, "judge", "judge step 1", 0.5, 1.25, {"tokens": 120}),
        Slice(1, "train", "train step 1", 1.25, 2.0),
    ]


def test_trace_is_chrome_trace_event_json(tmp_path):
    RunWriter(tmp_path).write_events(slices(), title="t")
    trace = json.loads((tmp_path / "trace.json").read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 3
    judge = next(e for e in complete if e["cat"] == "judge")
    assert (judge["ts"], judge["dur"], judge["tid"]) == (500000.0, 750000.0, 0)
    assert judge["args"] == {"role": "judge", "tokens": 120}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {"device 0", "device 1"}


def test_trace_writes_non_finite_arguments_as_null(tmp_path):
    def strict(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    write_trace([*slices(), Slice(1, "train", "step", 2.0, 3.0, {"loss": float("nan"), "nested": {"x": float("inf")}})],
                tmp_path / "trace.json")  # fmt: skip
    trace = json.loads((tmp_path / "trace.json").read_text(), parse_constant=strict)
    step = next(e for e in trace["traceEvents"] if e.get("name") == "step")
    assert step["args"] == {"role": "train", "loss": None, "nested": {"x": None}}
    assert next(e for e in trace["traceEvents"] if e.get("cat") == "judge")["args"]["tokens"] == 120


def lines_of(data: bytes) -> list:
    def strict(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    text = data.decode()
    assert text.endswith("\n")
    return [json.loads(line, parse_constant=strict) for line in text.splitlines()]


def test_jsonl_writes_one_row_a_line_cut_from_one_call():
    rows = [
        {"device": i, "name": f"r{i}", "start": i / 3, "args": {"tokens": i, "loss": float("nan")}} for i in range(5)
    ]
    assert lines_of(jsonl(rows)) == [{**r, "args": {"tokens": r["device"], "loss": None}} for r in rows]
    assert jsonl([]) == b""
    assert lines_of(jsonl([{"device": 0, "args": {3: "x"}}])) == [{"device": 0, "args": {"3": "x"}}]  # as json.dumps
    np = pytest.importorskip("numpy")
    assert lines_of(jsonl([{"x": np.float32(1.5), "n": np.int64(3), "a": np.arange(2)}])) == [
        {"x": 1.5, "n": 3, "a": [0, 1]}
    ]


def test_jsonl_falls_back_to_a_call_per_row_when_the_cut_would_be_wrong():
    # a nested object beginning with the rows' first key: cutting the whole list there would split a row
    nested = [{"device": 0, "args": [{"device": 9}]}, {"device": 1, "args": {"x": [{"device": 8}, {"device": 7}]}}]
    assert lines_of(jsonl(nested)) == nested
    mixed = [{"device": 0}, {"step": 1, "device": 2}, {"device": 3}]  # rows that do not share a first key
    assert lines_of(jsonl(mixed)) == mixed
    assert lines_of(jsonl([{}, {"device": 1}])) == [{}, {"device": 1}]


def test_run_files_write_non_finite_numbers_as_null(tmp_path):
    np = pytest.importorskip("numpy")
    w = RunWriter(tmp_path)
    w.write_json("summary.json", {"rate": float("inf"), "by_step": {1: float("nan")}, "x": np.float64(0.5)})
    w.step({"step": 1, "loss": float("nan")})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"rate": None, "by_step": {"1": None}, "x": 0.5}
    assert lines_of((tmp_path / "metrics.jsonl").read_bytes()) == [{"step": 1, "loss": None}]


class FakeAxes:
    def imshow(self, image, **kwargs) -> None:
        self.image, self.kwargs = image, kwargs


def test_many_devices_are_painted_as_pixel_rows_shifts_on_top(tmp_path):
    # device 0: rollout, a migration mark (no duration) and the rollout going on in the same time bin
    many = [
        Slice(0, "rollout", "r", 0.0, 4.0),
        Slice(0, "migrate", "m", 4.0, 4.0),
        Slice(0, "rollout", "r", 4.001, 10.0),
        Slice(99, "judge", "g", 5.0, 10.0),
    ]
    ax = FakeAxes()
    roles = _raster(ax, many, [0, 99], 0.0, 10.0)
    image, per_s = ax.image, RASTER_COLUMNS // 10
    code = {r: i + 1 for i, r in enumerate(ROLE_COLORS)}
    assert roles == {"rollout", "migrate", "judge"} and image.shape == (100, RASTER_COLUMNS)
    assert image[0, 4 * per_s] == code["migrate"]  # painted last: the later rollout slice does not hide it
    assert (image[0, : 4 * per_s] == code["rollout"]).all() and (image[0, 4 * per_s + 1 :] == code["rollout"]).all()
    assert (image[99, 5 * per_s :] == code["judge"]).all() and not image[99, : 5 * per_s].any()
    assert not image[1:99].any()  # devices with no slice stay idle (white)
    draw_timeline(many + [Slice(d, "train", "t", 1.0, 2.0) for d in range(1, 99)], tmp_path / "t.png", "many")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def test_a_resume_with_rows_missing_cuts_neither_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n" * 3)
    (tmp_path / "samples.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="samples.jsonl has 1 rows, its checkpoint saw 5"):
        RunWriter(tmp_path, keep=(2, 5))
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n" * 3
    RunWriter(tmp_path, keep=(2, 1))
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n" * 2


def test_a_damaged_events_file_is_a_user_error_naming_the_line(tmp_path, capsys):
    RunWriter(tmp_path).write_events(slices())
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write('{"device": 0, "role": "roll\n')
    assert main(["timeline", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'events.jsonl'} line 4: not JSON (" in err and "Traceback" not in err
    (tmp_path / "events.jsonl").write_text('{"device": 0}\n')
    assert main(["timeline", str(tmp_path)]) == 2
    assert "events.jsonl line 1: not an event's fields; the file is damaged" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["timeline.txt", "timeline"])
def test_a_timeline_picture_in_a_format_not_drawn_is_refused(name, tmp_path, capsys):
    RunWriter(tmp_path).write_events(slices())
    assert main(["timeline", str(tmp_path), "--out", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / name}: " in err and "one of .png, .pdf, .svg" in err and "Traceback" not in err
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("suffix, magic", [(".pdf", b"%PDF"), (".svg", b"<?xml")])
def test_the_timeline_is_drawn_in_the_format_its_suffix_names(suffix, magic, tmp_path):
    draw_timeline(slices(), tmp_path / f"t{suffix}")
    assert (tmp_path / f"t{suffix}").read_bytes().startswith(magic)


def test_a_run_files_rows_come_with_their_lines_and_a_damaged_line_is_named(tmp_path):
    from pivotrl.errors import UserError
    from pivotrl.telemetry import read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n')
    assert read_jsonl(path) == [(1, {"step": 1}), (3, {"step": 2})]
    path.write_text('{"step": 1}\n{"step": \n')
    with pytest.raises(UserError, match=rf"^{path} line 2: not JSON \(Expecting value: column 10\)$"):
        read_jsonl(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(UserError, match=rf"^{path} line 1: expected a JSON object, got list$"):
        read_jsonl(path)


def test_the_trace_holds_a_process_per_instance_with_its_devices_threads(tmp_path):
    slices = [Slice(d, "rollout", "r", 0.0, 1.0) for d in range(4)]
    write_trace(slices, tmp_path / "trace.json", {0: 0, 2: 0, 1: 1, 3: 1})  # (instances of two, as placed)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {e["tid"]: e["pid"] for e in events if e["name"] == "thread_name"}
    assert processes == {0: "instance 0", 1: "instance 1"} and threads == {0: 0, 1: 1, 2: 0, 3: 1}
    assert all(e["pid"] == threads[e["tid"]] for e in events if e["ph"] == "X")


def overlapping_rows() -> list[dict]:
    """Three steps, two in flight at a time (max_staleness=1): 2 begins with 1, 3 once 1 is trained."""
    return [
        {"step": 1, "at_s": {"start": 0.0, "rollout_end": 1.0, "judge_end": 1.5, "end": 2.0}},
        {"step": 2, "at_s": {"start": 0.0, "rollout_end": 1.8, "judge_end": 2.4, "end": 3.0}},
        {"step": 3, "at_s": {"start": 2.0, "rollout_end": 3.2, "judge_end": None, "end": 3.9}},  # (no judge tail)
        {"step": 4},  # (an on-policy row: no span)
    ]


def test_overlapping_steps_are_laid_on_lanes_apart():
    spans = step_spans(overlapping_rows())
    assert [(s.step, s.lane) for s in spans] == [(1, 0), (2, 1), (3, 0)]  # 3 takes the lane 1 freed at 2.0
    assert spans[2].phases() == [("rollout", 2.0, 3.2), ("judge", 3.2, 3.2), ("train", 3.2, 3.9)]


def test_the_trace_and_the_timeline_tell_overlapping_steps_apart(tmp_path, capsys):
    RunWriter(tmp_path).write_events(slices(), title="t", metrics=overlapping_rows())
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    steps = [e for e in events if e["ph"] == "X" and e["pid"] == STEPS_PID]
    assert {(e["name"], e["tid"]) for e in steps} >= {("step 1 rollout", 0), ("step 2 train", 1), ("step 3 train", 0)}
    first = next(e for e in steps if e["name"] == "step 2 judge")
    assert (first["ts"], first["dur"]) == (1.8e6, 0.6e6)
    lanes = {e["args"]["name"] for e in events if e.get("name") == "thread_name" and e["pid"] == STEPS_PID}
    assert lanes == {"steps, lane 0", "steps, lane 1"}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in overlapping_rows()))
    assert main(["timeline", str(tmp_path), "--out", str(tmp_path / "again.png")]) == 0  # (redrawn with its lanes)
    assert (tmp_path / "again.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_redrawn_timeline_names_the_instances_the_run_placed(tmp_path):
    from pivotrl.cli import _instances

    RunWriter(tmp_path).write_events(slices())
    assert _instances(tmp_path) is None  # (no summary: rows named by device)
    (tmp_path / "summary.json").write_text(json.dumps({"instances": {"0": 0, "1": 0}}))
    assert _instances(tmp_path) == {0: 0, 1: 0}
    assert main(["timeline", str(tmp_path)]) == 0
    (tmp_path / "summary.json").write_text("[1, 2]")  # (not a summary)
    assert _instances(tmp_path) is None
