"""Costs measured in a run of the real runtime, behind the same ``CostModel`` protocol as the roofline.

A run has one device per engine, on whatever it runs on (CPU threads for the
bundled tiny models, GPUs otherwise). What it can record maps onto this shape:
the (batch, context, seconds) of each engine step fit the decode line, prefill
and training divide seconds by tokens, and shifts are keyed by (from, to) role
as the planner's ``ShiftCosts`` keys them. With those numbers the simulator
replays the run and is checked against it before it is trusted at scale.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pivotrl.control.messages import ROLES, Role
from pivotrl.sim.costs import _check, _check_count, _check_tp
from pivotrl.sim.models import ModelSpec


def shift_key(src: Role | None, dst: Role) -> str:
    """``"rollout->train"``; a device's first load is ``"none->rollout"``."""
    return f"{'none' if src is None else src.value}->{dst.value}"


REQUIRED_SHIFTS = tuple(shift_key(a, b) for a in ROLES for b in ROLES if a is not b)
OPTIONAL_SHIFTS = tuple(shift_key(None, b) for b in ROLES)


def _check_field(where: str, kind: str, value: Any) -> None:
    if kind == "str":
        ok, allowed = isinstance(value, str) and value != "", "a non-empty string"
    elif kind == "int":
        ok, allowed = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an int >= 1"
    else:
        ok, allowed = not isinstance(value, bool) and isinstance(value, int | float), "a finite number >= 0"
        ok = ok and 0 <= value < math.inf
    if not ok:
        raise ValueError(f"{where}: got {value!r}, must be {allowed}")


def _check_all(obj: Any, where: str) -> None:
    for f in fields(obj):
        _check_field(f"{where}.{f.name}", str(f.type), getattr(obj, f.name))


def _parse(cls: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    names = [f.name for f in fields(cls)]
    for key in data:
        if key not in names:
            raise ValueError(f"{where}.{key}: unknown key; allowed: {', '.join(names)}")
    for f in fields(cls):
        if f.name not in data:
            raise ValueError(f"{where}.{f.name}: missing key")
        _check_field(f"{where}.{f.name}", str(f.type), data[f.name])
    return cls(**data)


@dataclass(frozen=True, slots=True)
class GenMeasure:
    """A generation role measured on one device (one engine, no tensor parallelism).

    A decode step of ``b`` sequences with ``c`` tokens of context each took
    ``step_base_s + step_per_seq_s * b + step_per_kv_token_s * b * c``: a linear fit over the
    (batch, context, seconds) of the engine's steps.
    """

    model: str  # the name of the model measured: the driver's ModelSpec of this role carries it
    step_base_s: float  # fixed cost of a step: weights read, launches, host overhead
    step_per_seq_s: float  # each sequence in the batch (its matmul rows and sampling)
    step_per_kv_token_s: float  # each token of KV cache the step attends over (batch * context)
    prefill_per_token_s: float  # prompt (or migrated prefix) tokens, prefilled in batches
    max_batch: int  # the engine's sequence slots
    max_len: int  # the longest sequence the engine's cache holds (prompt + output tokens)

    def __post_init__(self) -> None:
        _check_all(self, "GenMeasure")


@dataclass(frozen=True, slots=True)
class TrainMeasure:
    """The trainer measured on one device."""

    per_token_s: float  # forward + backward per sample token; n devices share the tokens
    optimizer_step_s: float  # gradient sync and update, as measured (taken as independent of the group size)

    def __post_init__(self) -> None:
        _check_all(self, "TrainMeasure")


@dataclass(frozen=True, slots=True)
class MeasuredCosts:
    """Costs measured by the real runtime for one policy/judge pair.

    As JSON (``to_dict`` / ``from_dict``; ``load`` / ``save`` for a file)::

        {"device": "cpu, 1 torch thread",
         "rollout": {"model": "policy", "step_base_s": ..., "step_per_seq_s": ..., "step_per_kv_token_s": ...,
                     "prefill_per_token_s": ..., "max_batch": 64, "max_len": 256},
         "genrm":   {"model": "genrm", ...the same keys...},
         "train":   {"per_token_s": ..., "optimizer_step_s": ...},
         "shift":   {"rollout->genrm": 0.4, "rollout->train": ..., ...every ordered pair of roles...}}

    The model arguments of the protocol pick the role by name (``rollout.model`` or
    ``genrm.model``); their shapes are ignored. Instances are one device (``tp`` 1). A
    ``"none->role"`` shift (first load) is optional: unmeasured, it costs the mean of the
    measured shifts into that role.
    """

    rollout: GenMeasure
    genrm: GenMeasure
    train: TrainMeasure
    shifts: dict[str, float]
    device: str = "unspecified"  # where it was measured, for reports

    def __post_init__(self) -> None:
        _check_field("device", "str", self.device)
        if self.rollout.model == self.genrm.model:
            raise ValueError(
                f"rollout.model and genrm.model are both {self.rollout.model!r}: roles are told apart "
                "by model name, so they must differ"
            )
        for key, seconds in self.shifts.items():
            if key not in REQUIRED_SHIFTS + OPTIONAL_SHIFTS:
                raise ValueError(f"shift.{key}: unknown key; allowed: {', '.join(REQUIRED_SHIFTS + OPTIONAL_SHIFTS)}")
            _check_field(f"shift.{key}", "float", seconds)
        for key in REQUIRED_SHIFTS:
            if key not in self.shifts:
                raise ValueError(f"shift.{key}: missing key (every ordered pair of roles is required)")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasuredCosts:
        if not isinstance(data, dict):
            raise ValueError(f"measured costs: expected an object, got {type(data).__name__}")
        allowed = ("device", "rollout", "genrm", "train", "shift")
        for key in data:
            if key not in allowed:
                raise ValueError(f"{key}: unknown key; allowed: {', '.join(allowed)}")
        for key in allowed[1:]:
            if key not in data:
                raise ValueError(f"{key}: missing key")
        if not isinstance(data["shift"], dict):
            raise ValueError(f"shift: expected an object, got {type(data['shift']).__name__}")
        return cls(
            rollout=_parse(GenMeasure, data["rollout"], "rollout"),
            genrm=_parse(GenMeasure, data["genrm"], "genrm"),
            train=_parse(TrainMeasure, data["train"], "train"),
            shifts=dict(data["shift"]),
            device=data.get("device", "unspecified"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "rollout": asdict(self.rollout),
            "genrm": asdict(self.genrm),
            "train": asdict(self.train),
            "shift": dict(self.shifts),
        }

    @classmethod
    def load(cls, path: str | Path) -> MeasuredCosts:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def _gen(self, model: ModelSpec, tp: int) -> GenMeasure:
        if tp != 1:
            raise ValueError(f"tp: got {tp}, measured costs are of one device per instance (tp 1)")
        for m in (self.rollout, self.genrm):
            if m.model == model.name:
                return m
        raise ValueError(
            f"model {model.name!r} was not measured: rollout is {self.rollout.model!r}, genrm {self.genrm.model!r}"
        )

    def decode_step(self, model: ModelSpec, tp: int, batch: int, mean_context: float) -> float:
        m = self._gen(model, tp)
        _check("batch", batch)
        _check("mean_context", mean_context)
        if batch == 0:
            return 0.0
        return m.step_base_s + batch * (m.step_per_seq_s + m.step_per_kv_token_s * mean_context)

    def decode_span(self, model: ModelSpec, tp: int, batch: int, context: float, steps: int) -> float:
        m = self._gen(model, tp)
        _check("batch", batch)
        _check("context", context)
        _check_count("steps", steps)
        if batch == 0:
            return 0.0
        kv_tokens = batch * (steps * context + steps * (steps - 1) / 2)  # context grows a token a step
        return steps * (m.step_base_s + batch * m.step_per_seq_s) + m.step_per_kv_token_s * kv_tokens

    def prefill(self, model: ModelSpec, tp: int, tokens: int, seq_len: int | None = None) -> float:
        _check("tokens", tokens)
        return tokens * self._gen(model, tp).prefill_per_token_s

    def max_batch(self, model: ModelSpec, tp: int, context_len: int) -> int:
        m = self._gen(model, tp)
        return m.max_batch if context_len <= m.max_len else 0

    def train_tokens(self, model: ModelSpec, tokens: int, n_gpus: int, seq_len: int = 0) -> float:
        if model.name != self.rollout.model:
            raise ValueError(f"model {model.name!r}: only the policy {self.rollout.model!r} is trained")
        _check_tp(n_gpus, "n_gpus")
        _check("tokens", tokens)
        return tokens * self.train.per_token_s / n_gpus

    def optimizer_step(self, model: ModelSpec, n_gpus: int) -> float:
        _check_tp(n_gpus, "n_gpus")
        return self.train.optimizer_step_s

    def shift(self, model: ModelSpec, src: Role | None, dst: Role, tp: int) -> float:
        if src is dst:
            return 0.0
        key = shift_key(src, dst)
        if key in self.shifts:
            return self.shifts[key]
        into = [s for k, s in self.shifts.items() if k.endswith(f"->{dst.value}") and not k.startswith("none")]
        return sum(into) / len(into)

    def migration(self, model: ModelSpec, tp: int, tokens: int) -> float:
        return self.prefill(model, tp, tokens)

    def refresh(self, model: ModelSpec, tp: int) -> float:
        """Not measured apart: a first load into rollout (``none->rollout``, else the mean measured shift
        into rollout), an upper bound since it includes the engine start."""
        self._gen(model, tp)
        return self.shift(model, None, Role.ROLLOUT, tp)
