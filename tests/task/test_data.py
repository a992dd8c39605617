"""Task data in each format (JSONL, parquet, a folder written by ``datasets``' ``save_to_disk``), with mapped
field names, and the one-line error for each kind of bad data."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pivotrl.cli import main
from pivotrl.config import ConfigError, load_config
from pivotrl.sample import Problem
from pivotrl.task.data import DataError, read_jsonl, read_problems, read_task, write_parquet

ROOT = Path(__file__).resolve().parents[2]
PROBLEMS = [Problem("1+1=", "2"), Problem(r"What is $\frac12 + \frac14$?", r"\frac{3}{4}"), Problem("3*3=", "9")]
MAPPED = ("problem", "answer")


def rows(problems: list[Problem] = PROBLEMS) -> dict[str, list[str]]:
    return {"problem": [p.question for p in problems], "answer": [p.reference for p in problems], "id": ["a", "b", "c"]}


def jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def dataset_folder(path: Path, columns: dict[str, list], shards: int = 1) -> Path:
    import datasets

    datasets.Dataset.from_dict(columns).save_to_disk(str(path), num_shards=shards)
    return path


def test_jsonl_with_mapped_fields(tmp_path: Path) -> None:
    table = rows()
    lines = [{k: table[k][i] for k in table} for i in range(3)]
    path = jsonl(tmp_path / "t.jsonl", [lines[0], "", lines[1], lines[2]])  # blank lines are skipped
    assert read_problems(path, *MAPPED) == PROBLEMS


def test_parquet_with_mapped_fields(tmp_path: Path) -> None:
    pq.write_table(pa.table(rows()), tmp_path / "t.parquet")
    assert read_problems(tmp_path / "t.parquet", *MAPPED) == PROBLEMS
    write_parquet(PROBLEMS, tmp_path / "w.parquet")  # the default names
    assert read_problems(tmp_path / "w.parquet") == PROBLEMS


@pytest.mark.parametrize("shards", [1, 2])
def test_save_to_disk_folder_with_mapped_fields(tmp_path: Path, shards: int) -> None:
    path = dataset_folder(tmp_path / "ds", rows(), shards)
    assert read_problems(path, *MAPPED) == PROBLEMS


def test_the_bundled_parquet_files_are_the_bundled_task(tmp_path: Path) -> None:
    for split in ("train", "heldout"):
        problems = read_jsonl(ROOT / f"data/arithmetic/{split}.jsonl")
        assert read_problems(ROOT / f"data/math_instruct/{split}.parquet", *MAPPED) == problems
        write_parquet(problems, tmp_path / f"{split}.parquet", *MAPPED)  # as docs/running.md wrote them
        assert read_problems(tmp_path / f"{split}.parquet", *MAPPED) == problems
        assert (ROOT / f"data/math_instruct/{split}.parquet").stat().st_size < 50_000


def test_read_task_uses_the_configs_fields(tmp_path: Path) -> None:
    pq.write_table(pa.table(rows()), tmp_path / "train.parquet")
    dataset_folder(tmp_path / "heldout", rows(PROBLEMS[:2]) | {"id": ["a", "b"]})
    cfg = load_config(
        None,
        [
            f"task.train_file={tmp_path / 'train.parquet'}",
            f"task.heldout_file={tmp_path / 'heldout'}",
            "task.question_field=problem",
            "task.reference_field=answer",
        ],
    )
    assert read_task(cfg.task) == (PROBLEMS, PROBLEMS[:2])


def error(tmp_path: Path, make) -> str:
    path = make(tmp_path)
    with pytest.raises(DataError) as e:
        read_problems(path, *MAPPED, key="task.train_file")
    msg = str(e.value)
    assert msg.startswith(f"task.train_file: {path}") or msg.startswith(f"task.train_file: '{path}'")
    assert "\n" not in msg
    return msg.split(": ", 1)[1]


def parquet(path: Path, columns: dict[str, list]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def text(path: Path, content: str) -> Path:
    path.write_text(content)
    return path


def dataset_dict(path: Path) -> Path:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows())}).save_to_disk(str(path))
    return path


BAD = {
    "jsonl broken line": (
        lambda d: jsonl(d / "t.jsonl", [{"problem": "q", "answer": "a"}, '{"problem": "q",']),
        "t.jsonl line 2: not valid JSON (Expecting property name enclosed in double quotes at column 17)",
    ),
    "jsonl unterminated string": (  # (json's own message ends with "starting at": no second "at")
        lambda d: jsonl(d / "t.jsonl", ['{"problem": "q']),
        "t.jsonl line 1: not valid JSON (Unterminated string starting at column 13)",
    ),
    "jsonl not an object": (
        lambda d: jsonl(d / "t.jsonl", ['["q", "a"]']),
        "t.jsonl line 1: expected a JSON object, got list",
    ),
    "jsonl missing field": (
        lambda d: jsonl(d / "t.jsonl", [{"problem": "q", "answer": "a"}, {"problem": "q", "solution": "a"}]),
        "t.jsonl line 2: no field 'answer' (task.reference_field; fields there: 'problem', 'solution')",
    ),
    "jsonl number": (
        lambda d: jsonl(d / "t.jsonl", [{"problem": "q", "answer": 7}]),
        "t.jsonl line 1: field 'answer' (task.reference_field) must be a string, got int 7",
    ),
    "jsonl null": (
        lambda d: jsonl(d / "t.jsonl", [{"problem": None, "answer": "a"}]),
        "t.jsonl line 1: field 'problem' (task.question_field) must be a string, got null",
    ),
    "jsonl empty": (lambda d: jsonl(d / "t.jsonl", ["", " "]), "t.jsonl: no problems"),
    "parquet missing column": (
        lambda d: parquet(d / "t.parquet", {"question": ["q"], "answer": ["a"]}),
        "t.parquet: no column 'problem' (task.question_field; columns: question, answer)",
    ),
    "parquet number": (
        lambda d: parquet(d / "t.parquet", {"problem": ["q", "r"], "answer": [1, 2]}),
        "t.parquet row 0: field 'answer' (task.reference_field) must be a string, got int 1",
    ),
    "parquet null": (
        lambda d: parquet(d / "t.parquet", {"problem": ["q", None], "answer": ["a", "b"]}),
        "t.parquet row 1: field 'problem' (task.question_field) must be a string, got null",
    ),
    "parquet unreadable": (
        lambda d: text(d / "t.parquet", "not parquet"),
        "t.parquet: not a readable parquet file",
    ),
    "folder missing column": (
        lambda d: dataset_folder(d / "ds", {"question": ["q"], "answer": ["a"]}),
        "ds: no column 'problem' (task.question_field; columns: question, answer)",
    ),
    "folder number": (
        lambda d: dataset_folder(d / "ds", {"problem": ["q", "r"], "answer": [1.0, 2.5]}),
        "ds row 0: field 'answer' (task.reference_field) must be a string, got float 1.0",
    ),
    "folder null in the second shard": (
        lambda d: dataset_folder(d / "ds", {"problem": ["q", "r", "s", None], "answer": ["1", "2", "3", "4"]}, 2),
        "ds row 3: field 'problem' (task.question_field) must be a string, got null",
    ),
    "folder of splits": (lambda d: dataset_dict(d / "dd"), "dd: a DatasetDict folder (splits: train); name one"),
    "folder not a dataset": (lambda d: d, "a folder without state.json, not one written by save_to_disk"),
    "unknown format": (
        lambda d: text(d / "t.csv", "problem,answer\n"),
        "unknown data format '.csv' (expected a .jsonl file, .parquet file, or folder written by",
    ),
    "missing": (lambda d: d / "nope.parquet", "not found (expected a .jsonl file"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_data_is_one_line_naming_file_line_and_field(tmp_path: Path, case: str) -> None:
    make, expected = BAD[case]
    assert expected in error(tmp_path, make)


def test_bad_data_stops_train_before_anything_runs(tmp_path: Path, capsys) -> None:
    path = jsonl(tmp_path / "t.jsonl", [{"question": "q", "reference": "a"}, {"question": "q", "reference": 3}])
    args = ["train", str(ROOT / "examples/default.yaml"), f"task.heldout_file={path}", "--out", str(tmp_path / "run")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"pivotrl: error: task.heldout_file: {path} line 2: field 'reference' (task.reference_field) "
        "must be a string, got int 3"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["task.question_field", "task.reference_field"])
def test_a_field_name_must_not_be_empty(key: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}: expected a non-empty field name, got ''"):
        load_config(None, [f"{key}=''"])
