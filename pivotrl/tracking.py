"""Run tracking: the numbers of ``metrics.jsonl`` and ``summary.json``, and the timeline, sent to TensorBoard
and to Weights & Biases as well (``log.tensorboard``, ``log.wandb``). The run directory's own files stay the
record; these are views of it, written beside them:

* ``RUN_DIR/tensorboard/`` - event files: a scalar per number of each step's row at global step = the step
  (nested keys joined with ``/``: ``time_s/rollout``), the summary's numbers as ``summary/...`` and the
  timeline as an image at the last step, the config as text.
* ``RUN_DIR/wandb/`` - a W&B run (offline by default: nothing leaves the machine, ``wandb sync`` uploads it
  later): the same scalars, the config, the summary's numbers in the run summary as ``summary/...``, the
  timeline as a ``wandb.Image``. ``RUN_DIR/wandb/run_id`` keeps the run's id.

A resumed run (``pivotrl train --resume``) redoes the steps after its checkpoint: TensorBoard's writer
purges the events at and after the first step redone (they are hidden when the files are read), so each
step shows once. W&B logs to the same run id: online, the run goes on, and W&B does not rewrite steps it
already has (the steps logged again are dropped, with a warning); offline, the resumed part is a second
offline run directory with the same id, which ``wandb sync`` uploads to that same run.

The job calls :func:`start`, then :meth:`Tracker.step` per row and :meth:`Tracker.finish` at the end (or
:meth:`Tracker.close` when the run fails). Nothing heavy is imported until a backend is turned on.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from pivotrl.config import JobConfig, LogConfig
from pivotrl.errors import UserError
from pivotrl.log import logger

EXTRA = "pip install 'pivotrl[tracking]'"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
WANDB_ID_FILE = "run_id"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check(log: LogConfig) -> None:
    """Stop the job before any device starts when a backend the config turns on is not installed here."""
    for key, on, module in (("log.tensorboard", log.tensorboard, "tensorboard"), ("log.wandb", log.wandb, "wandb")):
        if on and not _installed(module):
            raise UserError(
                f"{key}=true: {module} is not installed here; install it with pip install {module} "
                f"(or {EXTRA}), or set {key}=false"
            )


def scalars(row: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a row, nested keys joined with ``/``; strings, lists, booleans and non-finite
    numbers (null in ``metrics.jsonl``) are left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= scalars(value, f"{name}/")
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value) if isinstance(value, float) else int(value)
    return out


class Sink(Protocol):
    """One tracking backend."""

    def step(self, step: int, values: dict[str, float]) -> None: ...

    def finish(self, step: int, summary: dict[str, float], timeline: Path | None) -> None: ...

    def close(self, failed: bool) -> None: ...


class Tracker:
    """What the job calls; sends each row to every backend turned on (none: it does nothing)."""

    def __init__(self, sinks: list[Sink] | None = None, last_step: int = 0) -> None:
        self.sinks = sinks or []
        self.last_step = last_step

    def step(self, row: Mapping[str, Any]) -> None:
        if not self.sinks:
            return
        step = int(row["step"])
        values = scalars({k: v for k, v in row.items() if k != "step"})
        for sink in self.sinks:
            sink.step(step, values)
        self.last_step = max(self.last_step, step)

    def finish(self, summary: Mapping[str, Any], timeline_path: str | Path | None) -> None:
        """The summary's numbers and the timeline picture (when the file is there), then close."""
        numbers = scalars(summary, "summary/")
        timeline = Path(timeline_path) if timeline_path is not None and Path(timeline_path).is_file() else None
        for sink in self.sinks:
            sink.finish(self.last_step, numbers, timeline)
        self.close()

    def close(self, failed: bool = False) -> None:
        """Flush and close every backend; ``failed``: the run stopped on an error. Safe to call twice."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(failed)


def start(cfg: JobConfig, run_dir: str | Path, resumed_at: int | None = None) -> Tracker:
    """The backends ``cfg.log`` turns on, writing under ``run_dir``; ``resumed_at``: the step of the checkpoint a
    resumed run goes on from (the steps after it are written again)."""
    check(cfg.log)
    sinks: list[Sink] = []
    try:
        if cfg.log.tensorboard:
            sinks.append(TensorBoardSink(Path(run_dir) / TENSORBOARD_DIR, cfg, resumed_at))
        if cfg.log.wandb:
            sinks.append(WandbSink(Path(run_dir), cfg, resumed_at))
    except BaseException:
        Tracker(sinks).close(failed=True)
        raise
    return Tracker(sinks, resumed_at or 0)


class TensorBoardSink:
    """Event files through torch's ``SummaryWriter`` (the tensorboard package's format)."""

    def __init__(self, path: Path, cfg: JobConfig, resumed_at: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if resumed_at is None:  # a new run starts the directory afresh, as it does metrics.jsonl
            for old in path.glob("events.out.tfevents.*"):
                old.unlink()
        # a resume writes the steps after its checkpoint again: purge_step hides the earlier copies
        purge = None if resumed_at is None else resumed_at + 1
        self.writer = SummaryWriter(str(path), purge_step=purge)
        if resumed_at is None:
            self.writer.add_text("config", _code(json.dumps(cfg.to_dict(), indent=2)))
        logger.info("tensorboard: %s (tensorboard --logdir %s)", path, path)

    def step(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def finish(self, step: int, summary: dict[str, float], timeline: Path | None) -> None:
        for name, value in summary.items():
            self.writer.add_scalar(name, value, step)
        if timeline is not None:
            import numpy as np
            from PIL import Image

            with Image.open(timeline) as picture:
                pixels = np.asarray(picture.convert("RGB"))
            self.writer.add_image("timeline", pixels, step, dataformats="HWC")

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run under ``RUN_DIR/wandb``, its id kept in ``RUN_DIR/wandb/run_id`` for a resume."""

    def __init__(self, run_dir: Path, cfg: JobConfig, resumed_at: int | None) -> None:
        log = cfg.log
        offline = log.wandb_mode == "offline"
        if offline:  # nothing leaves the machine: not even wandb's own error reports
            os.environ["WANDB_ERROR_REPORTING"] = "false"
        import wandb

        self.wandb = wandb
        folder = run_dir / WANDB_DIR
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resumed_at is not None and id_file.is_file() else ""
        run_id = run_id or secrets.token_hex(4)  # W&B ids: 8 lowercase letters or digits
        id_file.write_text(run_id + "\n")
        # offline: no system metrics or machine metadata either (probes of cloud metadata addresses among them)
        quiet = dict(x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True) if offline else {}
        self.run = wandb.init(
            project=log.wandb_project,
            name=log.wandb_run_name or run_dir.resolve().name,
            dir=str(run_dir),
            mode=log.wandb_mode,
            id=run_id,
            resume="allow",
            config=cfg.to_dict(),
            settings=wandb.Settings(console="off", **quiet),
        )
        logger.info("wandb: run %s (%s) in %s", run_id, log.wandb_mode, folder)

    def step(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self, step: int, summary: dict[str, float], timeline: Path | None) -> None:
        self.run.summary.update(summary)
        if timeline is not None:
            self.run.log({"timeline": self.wandb.Image(str(timeline))}, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _code(text: str) -> str:
    """Text as a Markdown code block (TensorBoard renders text summaries as Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())
