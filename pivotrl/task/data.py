"""Task data: problems (question and reference answer) read from JSONL, parquet or a ``datasets`` folder.

The format follows the path: a ``.jsonl`` file (one JSON object a line), a
``.parquet`` file, or a directory written by ``datasets``'
``Dataset.save_to_disk`` (Arrow stream files listed in its ``state.json``).
That folder is read with pyarrow, so running a job needs no ``datasets``
install. Which fields hold the question and the reference is configurable
(``task.question_field``, ``task.reference_field``): public data sets name
them ``problem``/``solution``, ``prompt``/``answer`` and so on.

A bad file stops the job before any work starts, with one line that names
the file, the line (JSONL, counted from 1) or row (parquet and ``datasets``,
counted from 0 as ``dataset[i]`` does) and the field: a value must be a
string, never silently converted (a number in a reference column is as
likely a data mistake as an answer).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivotrl.errors import UserError
from pivotrl.sample import Problem

if TYPE_CHECKING:
    from pivotrl.config import TaskConfig

FORMATS = ".jsonl file, .parquet file, or folder written by datasets' save_to_disk"


class DataError(UserError):
    """A task data file that cannot be read as problems; the message names the file, the line or row,
    and the field."""


def read_problems(
    path: str | Path, question_field: str = "question", reference_field: str = "reference", key: str = ""
) -> list[Problem]:
    """Every problem in the data at ``path``, in order; ``key`` (the config key that named the path)
    starts every error message, so the user knows which setting to fix."""
    path = Path(path)
    where = f"{key}: " if key else ""
    fields = _Fields(question_field, reference_field)
    if path.is_dir():
        rows: Iterable[tuple[str, Any]] = _dataset_rows(path, where, fields)
    elif not path.exists():
        raise DataError(f"{where}{str(path)!r} not found (expected a {FORMATS})")
    elif path.suffix == ".jsonl":
        rows = _jsonl_rows(path, where)
    elif path.suffix == ".parquet":
        rows = _parquet_rows(path, where, fields)
    else:
        raise DataError(
            f"{where}{str(path)!r}: unknown data format {path.suffix or '(no suffix)'!r} (expected a {FORMATS})"
        )
    out = [fields.problem(row, f"{where}{path} {at}") for at, row in rows]
    if not out:
        raise DataError(f"{where}{path}: no problems")
    return out


def read_task(task: TaskConfig) -> tuple[list[Problem], list[Problem]]:
    """The job's (train, held-out) problems, as ``task`` names and maps them."""
    fields = task.question_field, task.reference_field
    return (
        read_problems(task.train_file, *fields, key="task.train_file"),
        read_problems(task.heldout_file, *fields, key="task.heldout_file"),
    )


def read_jsonl(path: str | Path) -> list[Problem]:
    """A JSONL file with ``question`` and ``reference`` strings (the bundled task's format)."""
    return read_problems(path)


def write_parquet(
    problems: list[Problem], path: str | Path, question_field: str = "question", reference_field: str = "reference"
) -> None:
    """Problems as a parquet file with the two string columns named as given (zstd-compressed: small to ship)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {question_field: [p.question for p in problems], reference_field: [p.reference for p in problems]}
    pq.write_table(pa.table(columns), path, compression="zstd")


class _Fields:
    """The two mapped field names, and the check of one row against them."""

    def __init__(self, question: str, reference: str) -> None:
        self.names = {"question": question, "reference": reference}

    def problem(self, row: Any, at: str) -> Problem:
        if not isinstance(row, Mapping):
            raise DataError(f"{at}: expected a JSON object, got {type(row).__name__}")
        values = []
        for role, name in self.names.items():
            if name not in row:
                fields = ", ".join(map(repr, row)) or "none"
                raise DataError(f"{at}: no field {name!r} (task.{role}_field; fields there: {fields})")
            value = row[name]
            if not isinstance(value, str):
                got = "null" if value is None else f"{type(value).__name__} {value!r}"[:80]
                raise DataError(f"{at}: field {name!r} (task.{role}_field) must be a string, got {got}")
            values.append(value)
        return Problem(*values)

    def columns(self, names: list[str], at: str) -> list[str]:
        """The two columns to read, checked against a table's columns before reading any row."""
        for role, name in self.names.items():
            if name not in names:
                raise DataError(f"{at}: no column {name!r} (task.{role}_field; columns: {', '.join(names) or 'none'})")
        return list(self.names.values())


def _jsonl_rows(path: Path, where: str) -> Iterator[tuple[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{where}{path}: cannot be read ({e})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            at = "" if e.msg.endswith(" at") else " at"  # ("Unterminated string starting at": no second "at")
            raise DataError(f"{where}{path} line {n}: not valid JSON ({e.msg}{at} column {e.colno})") from None
        yield f"line {n}", row


def _parquet_rows(path: Path, where: str, fields: _Fields) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        columns = fields.columns(schema.names, f"{where}{path}")
        table = pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{where}{path}: not a readable parquet file ({e})") from None
    yield from _table_rows(table, 0)


def _dataset_rows(path: Path, where: str, fields: _Fields) -> Iterator[tuple[str, Any]]:
    """Rows of a ``Dataset.save_to_disk`` folder: the Arrow stream files its ``state.json`` lists, in order."""
    import pyarrow as pa

    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise DataError(
            f"{where}{path}: a DatasetDict folder (splits: {', '.join(splits) or 'none'}); name one split's folder, "
            f"e.g. {path / (splits[0] if splits else 'train')}"
        )
    state = path / "state.json"
    try:
        files = [f["filename"] for f in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except FileNotFoundError:
        raise DataError(f"{where}{path}: a folder without state.json, not one written by save_to_disk") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{where}{state}: not a save_to_disk state file ({type(e).__name__}: {e})") from None
    first = 0
    for name in files:
        try:
            with pa.memory_map(str(path / name)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{where}{path / name}: not a readable Arrow file ({e})") from None
        columns = fields.columns(table.column_names, f"{where}{path}")
        yield from _table_rows(table.select(columns), first)
        first += table.num_rows


def _table_rows(table: Any, first: int) -> Iterator[tuple[str, Any]]:
    for i, row in enumerate(table.to_pylist(), first):
        yield f"row {i}", row
