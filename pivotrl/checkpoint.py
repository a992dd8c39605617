"""Checkpoints of a run and resuming from them (``checkpoint.every``, ``pivotrl train --resume RUN_DIR``).

A checkpoint is written at a step boundary, after the update of step k, from
what the GPS holds then; the run goes on meanwhile only once it is on disk.
Its layout::

    RUN_DIR/checkpoints/step_000010/
      policy/        the policy of version k as an HF checkpoint (config.json, safetensors, tokenizer)
      gps/           the GPS entries a resume publishes again: the policy's weights of version k, and its
                     optimizer state (one entry, or one per shard of a sharded trainer, as written)
      state.json     the step loop's position (pivotrl.control.controller.Controller.checkpoint), the job
                     config, the rows of metrics.jsonl and samples.jsonl written up to it
      manifest.json  the SHA-256 of every other file, written last

It is written under a temporary name and renamed when complete, so a killed
driver leaves either a whole checkpoint or none. At resume every file is
checked against the manifest; a checkpoint that fails is skipped with one line
saying so, and the one before it is used.

Why a resume is exact: a sample depends only on (job seed, step, sample) and
the weights, which the checkpoint holds with the optimizer state; the step
loop restarts from its position (the evaluation that was running included).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pivotrl.errors import UserError
from pivotrl.gps import Kind, ParameterStore, VersionError
from pivotrl.log import logger
from pivotrl.model import save_model

FORMAT = 1
DIR = "checkpoints"
PREFIX = "step_"


class CheckpointError(UserError):
    """Nothing to resume from, or a resume the run's state does not allow."""


@dataclass(slots=True, frozen=True)
class Entry:
    """One GPS entry kept in a checkpoint: read from ``source``, published again as ``name``."""

    source: str
    name: str
    version: int
    kind: Kind


@dataclass(slots=True)
class Checkpoint:
    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def restore(self, store: ParameterStore) -> int:
        """Publish the checkpoint's GPS entries again; returns the bytes published."""
        nbytes = 0
        for info in self.state["entries"]:
            tensors = load_file(self.path / "gps" / f"{info['file']}.safetensors")
            meta = json.loads((self.path / "gps" / f"{info['file']}.json").read_text())
            nbytes += store.publish(info["name"], info["version"], tensors, Kind(info["kind"]), meta).nbytes
        return nbytes


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _plain(x: Any) -> Any:
    """JSON-safe copy of GPS manifest metadata (tuples become lists)."""
    return json.loads(json.dumps(x, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def write(
    run_dir: str | Path,
    store: ParameterStore,
    entries: list[Entry],
    state: dict[str, Any],
    keep: int,
) -> Path:
    """Write one checkpoint of ``state`` (must hold ``step``) with the GPS ``entries``; keep the ``keep`` newest.

    The first entry is the policy's weights: it is also written as an HF
    checkpoint under ``policy/``.
    """
    from pivotrl.runtime.contexts import build_model

    t0 = time.perf_counter()
    root = Path(run_dir) / DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{int(state['step']):06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "gps").mkdir(parents=True)
    saved = []
    for i, e in enumerate(entries):
        snap = store.fetch(e.source, e.version, e.kind)
        file = f"{i:02d}-{e.name}-v{e.version}-{e.kind.value}"
        save_file({k: v.contiguous() for k, v in snap.state_dict().items()}, tmp / "gps" / f"{file}.safetensors")
        (tmp / "gps" / f"{file}.json").write_text(json.dumps(_plain(snap.manifest.meta)))
        saved.append({"file": file, "name": e.name, "version": e.version, "kind": e.kind.value})
        if i == 0:
            model, tok = build_model(snap, torch.device("cpu"), torch.float32)
            save_model(model, tok, tmp / "policy")
    (tmp / "state.json").write_text(json.dumps({**state, "format": FORMAT, "entries": saved}, indent=1))
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(tmp)): _sha256(p) for p in files}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(p.stat().st_size for p in files)
    shutil.rmtree(final, ignore_errors=True)  # a checkpoint of this step from a run that was resumed before it
    os.replace(tmp, final)
    for old in sorted(_checkpoints(root))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    logger.info(
        "checkpoint of step %s: %s (%.1f MB in %.2f s)", state["step"], final, size / 1e6, time.perf_counter() - t0
    )
    return final


def _checkpoints(root: Path) -> list[Path]:
    return [p for p in root.glob(f"{PREFIX}*") if p.is_dir()] if root.is_dir() else []


def verify(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be used, or None when every file matches its checksum."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return "no manifest.json"
    try:
        expected = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return "manifest.json is not JSON"
    for name, digest in expected.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if _sha256(f) != digest:
            return f"{name} fails its checksum"
    return None


def latest(run_dir: str | Path) -> Checkpoint:
    """The newest checkpoint of the run whose files all match their checksums; the ones that fail are skipped,
    one line each. Leftover temporary directories (a driver killed mid-write) are removed."""
    root = Path(run_dir) / DIR
    for tmp in root.glob(".tmp-*") if root.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True)
    for path in sorted(_checkpoints(root), reverse=True):
        problem = verify(path)
        if problem is None:
            return Checkpoint(path, json.loads((path / "state.json").read_text()))
        logger.warning("checkpoint %s skipped: %s; trying the one before", path.name, problem)
    raise CheckpointError(f"{run_dir}: no usable checkpoint under {root} (checkpoint.every writes them)")


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether the run has a checkpoint directory at all (``latest`` says whether one is usable)."""
    return bool(_checkpoints(Path(run_dir) / DIR))


def free(store: ParameterStore, entries: list[Entry]) -> None:
    """Drop GPS entries that were copied only for a checkpoint."""
    for e in entries:
        try:
            store.free(e.source, e.version, e.kind)
        except (VersionError, KeyError):
            pass
