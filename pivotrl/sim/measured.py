"""Costs measured in a run of the real runtime, behind the same ``CostModel`` protocol as the roofline.

A run has one device per engine, on whatever it runs on (CPU threads for the
bundled tiny models, GPUs otherwise). What it can record maps onto this shape:
the (batch, context, seconds) of each engine step fit the decode line, prefill
and training divide seconds by tokens, and shifts are keyed by (from, to) role
as the planner's ``ShiftCosts`` keys them. With those numbers the simulator
replays the run and is checked against it before it is trusted at scale
(``fit_run`` reads them off a run directory; ``benchmarks/fidelity.py``
compares the replay with the run).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from statistics import fmean, median, pstdev
from typing import Any

from pivotrl.control.messages import ROLES, Role
from pivotrl.control.profiles import nonneg_fit
from pivotrl.sim.costs import SPREAD_KINDS, _check, _check_count, _check_tp, check_spread_kind
from pivotrl.sim.models import ModelSpec
from pivotrl.telemetry import read_jsonl


def shift_key(src: Role | None, dst: Role) -> str:
    """``"rollout->train"``; a device's first load is ``"none->rollout"``."""
    return f"{'none' if src is None else src.value}->{dst.value}"


REQUIRED_SHIFTS = tuple(shift_key(a, b) for a in ROLES for b in ROLES if a is not b)
REFRESH = shift_key(Role.ROLLOUT, Role.ROLLOUT)  # a rollout device taking the next policy version, engine kept
OPTIONAL_SHIFTS = (*(shift_key(None, b) for b in ROLES), REFRESH)


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
            if f.default is not MISSING:  # optional: a profile written before the field existed
                continue
            raise ValueError(f"{where}.{f.name}: missing key")
        _check_field(f"{where}.{f.name}", str(f.type), data[f.name])
    return cls(**data)


def _as_dict(obj: Any) -> dict[str, Any]:
    """The fields of a measure; an optional one at its default is left out, as a file without it reads."""
    return {f.name: getattr(obj, f.name) for f in fields(obj) if getattr(obj, f.name) != f.default}


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
    # each accumulate call besides its tokens (Python, padding to a micro-batch's longest sample, the command's
    # round trip): optional, 0 when not measured
    per_call_s: float = 0.0

    def __post_init__(self) -> None:
        _check_all(self, "TrainMeasure")


@dataclass(frozen=True, slots=True)
class MeasuredCosts:
    """Costs measured by the real runtime for one policy/judge pair.

    As JSON (``to_dict`` / ``from_dict``; ``load`` / ``save`` for a file)::

        {"device": "cpu, 1 torch thread",
         "rollout": {"model": "policy", "step_base_s": ..., "step_per_seq_s": ..., "step_per_kv_token_s": ...,
                     "prefill_per_token_s": ..., "max_batch": 64, "max_len": 256},
         "judge":   {"model": "judge", ...the same keys...},
         "train":   {"per_token_s": ..., "optimizer_step_s": ..., "per_call_s": ...},
         "shift":   {"rollout->judge": 0.4, "rollout->train": ..., ...every ordered pair of roles...},
         "spread":  {"shift": 0.8, "accumulate": 0.4, "optimizer": 0.9}}

    The model arguments of the protocol pick the role by name (``rollout.model`` or
    ``genrm.model``); their shapes are ignored. Instances are one device (``tp`` 1). A
    ``"none->role"`` shift (first load) is optional: unmeasured, it costs the mean of the
    measured shifts into that role. So is ``"rollout->rollout"``, a rollout device taking
    the next policy version in its running engine (``refresh``): unmeasured, it costs a
    first load into rollout. So is ``train.per_call_s`` (0 when left out). So is ``spread``:
    the coefficient of variation of each kind of operation in ``SPREAD_KINDS`` about its
    seconds (a kind left out, or the whole object, is 0: every one takes exactly its seconds).
    """

    rollout: GenMeasure
    genrm: GenMeasure
    train: TrainMeasure
    shifts: dict[str, float]
    device: str = "unspecified"  # where it was measured, for reports
    # kind (SPREAD_KINDS) -> coefficient of variation of one operation's seconds about the above; 0 if absent
    spreads: dict[str, float] = field(default_factory=dict)

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
        if not isinstance(self.spreads, dict):
            raise ValueError(f"spread: expected an object, got {type(self.spreads).__name__}")
        for key, cv in self.spreads.items():
            if key not in SPREAD_KINDS:
                raise ValueError(f"spread.{key}: unknown key; allowed: {', '.join(SPREAD_KINDS)}")
            _check_field(f"spread.{key}", "float", cv)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasuredCosts:
        if not isinstance(data, dict):
            raise ValueError(f"measured costs: expected an object, got {type(data).__name__}")
        required = ("rollout", "judge", "train", "shift")
        allowed = ("device", *required, "spread")
        data = _judge_named(data)
        for key in data:
            if key not in allowed:
                raise ValueError(f"{key}: unknown key; allowed: {', '.join(allowed)}")
        for key in required:
            if key not in data:
                raise ValueError(f"{key}: missing key")
        if not isinstance(data["shift"], dict):
            raise ValueError(f"shift: expected an object, got {type(data['shift']).__name__}")
        return cls(
            rollout=_parse(GenMeasure, data["rollout"], "rollout"),
            genrm=_parse(GenMeasure, data["judge"], "judge"),
            train=_parse(TrainMeasure, data["train"], "train"),
            shifts=dict(data["shift"]),
            device=data.get("device", "unspecified"),
            spreads=data.get("spread", {}),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "rollout": _as_dict(self.rollout),
            "judge": _as_dict(self.genrm),
            "train": _as_dict(self.train),
            "shift": dict(self.shifts),
            **({"spread": dict(self.spreads)} if self.spreads else {}),
        }

    @classmethod
    def load(cls, path: str | Path) -> MeasuredCosts:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def fit(cls, run_dir: str | Path) -> MeasuredCosts:
        """Fitted to a run directory of the real runtime: ``fit_run(run_dir).costs``."""
        return fit_run(run_dir).costs

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

    def kv_tokens(self, model: ModelSpec, tp: int) -> None:
        return None  # the measured engine has fixed slots (rollout.max_batch)

    def train_tokens(self, model: ModelSpec, tokens: int, n_gpus: int, seq_len: int = 0) -> float:
        if model.name != self.rollout.model:
            raise ValueError(f"model {model.name!r}: only the policy {self.rollout.model!r} is trained")
        _check_tp(n_gpus, "n_gpus")
        _check("tokens", tokens)
        if tokens == 0:
            return 0.0
        return self.train.per_call_s + tokens * self.train.per_token_s / n_gpus

    def optimizer_step(self, model: ModelSpec, n_gpus: int) -> float:
        _check_tp(n_gpus, "n_gpus")
        return self.train.optimizer_step_s

    def regroup(self, model: ModelSpec, n_gpus: int) -> float:
        """0: the measured optimizer steps include the groups their runs made."""
        _check_tp(n_gpus, "n_gpus")
        return 0.0

    def shift(self, model: ModelSpec, src: Role | None, dst: Role, tp: int) -> float:
        if src is dst:
            return 0.0
        key = shift_key(src, dst)
        if key in self.shifts:
            return self.shifts[key]
        into = [s for k, s in self.shifts.items() if k.endswith(f"->{dst.value}") and k in REQUIRED_SHIFTS]
        return sum(into) / len(into)

    def migration(self, model: ModelSpec, tp: int, tokens: int) -> float:
        return self.prefill(model, tp, tokens)

    def spread(self, kind: str) -> float:
        check_spread_kind(kind)
        return self.spreads.get(kind, 0.0)

    def refresh(self, model: ModelSpec, tp: int) -> float:
        """``rollout->rollout`` as measured; else a first load into rollout (``none->rollout``, else the
        mean measured shift into rollout), an upper bound since it includes the engine start."""
        self._gen(model, tp)
        if REFRESH in self.shifts:
            return self.shifts[REFRESH]
        return self.shift(model, None, Role.ROLLOUT, tp)


# -- fitting a profile from a run ------------------------------------------------------------
#
# A generation slice of events.jsonl (``Worker.run``: engine steps for about 50 ms between two
# looks at the control plane) carries ``tokens`` (one per sequence per step, prefills included),
# ``running`` (the engine's load when it began), ``finished``, ``steps`` (decode steps) and, when
# it prefilled, ``prefill_tokens`` and ``prefill_s``. A device's slices are replayed in order to
# recover the rest of a row ``seconds = base * steps + per_seq * decode + per_kv * kv_tokens``:
#
#   admitted   load - the sequences still running after the previous slice of the same role
#              (0 after anything else: a shift, an abort, training, an engine run dry)
#   decode     tokens - admitted (an admitted sequence samples its first token in the prefill)
#   kv_tokens  the batch starts at the load (at most max_batch) and loses its finished sequences
#              evenly over the slice; contexts are the prefill plus a token a step, and a finished
#              sequence leaves with the mean context
#   steps      when not logged (older runs): decode = steps * (load - finished / 2)


GEN_ROLES = ("rollout", "judge")


def _judge_named(obj: dict[str, Any], fields: tuple[str, ...] = ()) -> dict[str, Any]:
    """A file this project wrote (a costs file, a run's events) in today's names: the judge's role was once
    ``genrm``, in keys and shift pairs (``rollout->genrm``), and in the ``fields`` named (an event's role and
    name). Other values (a model's name) are left as they are."""
    old = lambda text: re.sub(r"\bgenrm\b", "judge", text)  # noqa: E731
    out = {}
    for k, v in obj.items():
        if isinstance(v, dict):
            v = _judge_named(v)
        elif k in fields and isinstance(v, str):
            v = old(v)
        out[old(k) if isinstance(k, str) else k] = v
    return out


@dataclass(slots=True)
class _GenSlice:
    """One generation slice with what the replay recovered."""

    device: int
    role: str
    start: float
    end: float
    prefill_tokens: int
    prefill_s: float
    admitted: int
    steps: float
    decode_tokens: float
    kv_tokens: float
    gap_s: float | None = None  # until the device's next slice, when work was left for it (a round trip)


@dataclass(frozen=True, slots=True)
class RunFit:
    """A cost profile read off one run, with the run's slice cadence and what the fit saw."""

    costs: MeasuredCosts
    slice_s: float  # the median period of a device's generation slices, one start to the next (sim.slice_s)
    # per role: slices fitted, their rms error, the round trip, tokens prefilled per admitted sequence; the
    # train spans used; every fallback taken
    report: dict[str, Any]


def nonneg_least_squares(
    rows: list[tuple[float, ...]], y: list[float], weights: list[float] | None = None
) -> list[float]:
    """Weighted least squares with every coefficient >= 0 (``nonneg_fit`` over the rows' normal
    equations): a term the data cannot tell apart from the others (a context that barely varies,
    say) drops out at 0 rather than going negative."""
    k = len(rows[0])
    w = weights or [1.0] * len(rows)
    gram = [[sum(wi * r[i] * r[j] for r, wi in zip(rows, w, strict=True)) for j in range(k)] for i in range(k)]
    moment = [sum(wi * r[i] * t for r, t, wi in zip(rows, y, w, strict=True)) for i in range(k)]
    return nonneg_fit(gram, moment, sum(wi * t * t for t, wi in zip(y, w, strict=True)))


def simulated(run_dir: str | Path) -> bool:
    """Whether ``pivotrl simulate`` wrote the run directory: its summary.json has the ``sim`` section, or, in a
    run cut short before it wrote one, its samples carry token counts (``response_tokens``) and no tokens."""
    run = Path(run_dir)
    try:
        summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = None
    if isinstance(summary, dict):
        return "sim" in summary or "sim_seconds" in summary
    try:
        with (run / "samples.jsonl").open(encoding="utf-8") as f:
            row = json.loads(next((line for line in f if line.strip()), "null"))
    except (OSError, ValueError):
        return False
    return isinstance(row, dict) and "response_tokens" in row and "response_ids" not in row


def _read_run(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    run = Path(run_dir)
    if not run.is_dir():
        raise ValueError("not a run directory (it does not exist)")
    for name in ("config.json", "events.jsonl"):
        if not (run / name).is_file():
            raise ValueError(f"not a run directory (no {name})")
    if simulated(run):
        raise ValueError(
            "a simulated run (`pivotrl simulate` wrote it), whose costs are the simulator's own; "
            "profile measures a run of `pivotrl train`"
        )
    try:
        config = json.loads((run / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"config.json: not JSON ({e.msg})") from None
    if not isinstance(config, dict):
        raise ValueError("config.json: expected an object")
    events = []
    keys = ("device", "role", "name", "start", "end")
    for lineno, e in read_jsonl(run / "events.jsonl"):
        if any(k not in e for k in keys) or not isinstance(e.get("args", {}), dict):
            raise ValueError(f"events.jsonl:{lineno}: expected an object with {', '.join(keys)} and args")
        e.setdefault("args", {})
        events.append(_judge_named(e, ("role", "name")))
    return config, events


def _config_int(config: dict[str, Any], section: str, key: str) -> int:
    value = config[section].get(key) if isinstance(config.get(section), dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json: {section}.{key}: got {value!r}, expected an int >= 1")
    return value


def _replay(events: list[dict[str, Any]], max_batch: int) -> tuple[list[_GenSlice], int]:
    """Each device's generation slices in order, with admitted sequences, steps and KV tokens recovered;
    and how many slices disagreed with the replay (their running count was taken from the load)."""
    skipped = 0
    by_device: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        by_device.setdefault(e["device"], []).append(e)
    out: list[_GenSlice] = []
    for device, evs in sorted(by_device.items()):
        evs.sort(key=lambda e: (e["start"], e["end"]))
        running, context, last = 0, 0.0, None  # sequences left running, their summed context, the last slice
        for i, e in enumerate(evs):
            a = e["args"]
            if e["role"] not in GEN_ROLES or "tokens" not in a:
                last = None
                continue
            if "running" not in a or "finished" not in a:
                raise ValueError(f"device {device}: a {e['role']} slice at {e['start']:.3f} s has no running/finished")
            if last is None or last.role != e["role"]:
                running, context = 0, 0.0
            load, tokens, finished = int(a["running"]), int(a["tokens"]), int(a["finished"])
            prefill_tokens, prefill_s = int(a.get("prefill_tokens", 0)), float(a.get("prefill_s", 0.0))
            waiting = load - running
            if waiting < 0 or ((waiting > 0) != (prefill_tokens > 0) and running < max_batch):  # out of step
                if prefill_tokens:  # the engine was empty after all: everything is admitted here
                    running, context = 0, 0.0
                else:  # nothing was admitted: all of the load was running
                    running, context = min(load, max_batch), context / max(running, 1) * min(load, max_batch)
                skipped += 1
            batch = min(load, max_batch)
            admitted = load - running if load <= max_batch else min(load - running, max_batch - running + finished)
            decode = max(0, tokens - admitted)
            context += prefill_tokens + admitted
            steps = kv = 0.0
            if decode and batch:
                gone = min(finished, batch)
                if isinstance(a.get("steps"), int) and a["steps"] > 0:  # logged by newer runs
                    steps = float(a["steps"])
                else:
                    steps = min(max((decode - gone / 2) / (batch - gone / 2), decode / batch), float(decode))
                mean_ctx = context / batch
                if isinstance(a.get("kv"), int) and a["kv"] > 0:  # counted by the engine (newer runs)
                    kv = float(a["kv"])
                else:  # batch b_k = batch - gone * k / steps at step k, context mean_ctx + k: sum of b_k (mean_ctx + k)
                    kv = mean_ctx * decode + batch * steps * (steps - 1) / 2 - gone * (steps - 1) * (2 * steps - 1) / 6
            running = max(0, running + admitted - finished)
            context = running * (context / max(batch, 1) + steps) if running else 0.0
            g = _GenSlice(device, e["role"], e["start"], e["end"], prefill_tokens, prefill_s, admitted, steps,
                          float(decode), max(kv, 0.0))  # fmt: skip
            nxt = evs[i + 1] if i + 1 < len(evs) else None
            if load > finished and nxt is not None and nxt["role"] == e["role"] and "tokens" in nxt["args"]:
                g.gap_s = max(0.0, nxt["start"] - e["end"])  # work was left: the next slice came at once
            out.append(g)
            last = g
    return out, skipped


def _fit_generation(slices: list[_GenSlice], role: str, steady: float) -> tuple[dict[str, float], dict[str, Any]]:
    """The decode line and prefill rate of one role from its slices after ``steady``.

    A slice's seconds are its length less its prefill steps, plus the round trip to the next slice
    (the device waits while its report goes to the control plane and the next slice comes back; a
    slice that ran its engine dry pays the role's median round trip): the simulator reports at slice
    ends without delay, so the line carries that time.

    The fit is of the time per step, each slice weighted by its steps. A slice lasts about as long
    as the runtime's slice whatever its steps cost, so a plain fit of slice seconds on steps would
    read the slices whose steps ran fast (more of them) as evidence of a cheap step; per step, the
    fitted line adds up to the measured time of all the slices."""
    mine = [g for g in slices if g.role == role]
    if not mine:
        raise ValueError(f"no {role} generation slices in events.jsonl (a run of this version logs them)")
    gaps = [g.gap_s for g in mine if g.gap_s is not None]
    gap = median(gaps) if gaps else 0.0
    used = [g for g in mine if g.start >= steady] or mine
    rows = [(g.steps, g.decode_tokens, g.kv_tokens) for g in used if g.decode_tokens > 0]
    y = [g.end - g.start - g.prefill_s + (gap if g.gap_s is None else g.gap_s) for g in used if g.decode_tokens > 0]
    if len(rows) < 3:
        raise ValueError(f"{len(rows)} {role} slices with decode steps: too few to fit a decode line (need 3)")
    coef = nonneg_least_squares(rows, y, [1 / r[0] for r in rows])
    pred = [sum(c * v for c, v in zip(coef, r, strict=True)) for r in rows]
    scale = sum(y) / sum(pred) if sum(pred) > 0 else 1.0  # 1 unless the base term dropped out
    coef = [c * scale for c in coef]
    rms = math.sqrt(sum((t - p * scale) ** 2 for t, p in zip(y, pred, strict=True)) / len(y))
    prefill = [g for g in used if g.prefill_tokens > 0]
    if not prefill:
        raise ValueError(f"no timed {role} prefill in events.jsonl")
    per_token = sum(g.prefill_s for g in prefill) / sum(g.prefill_tokens for g in prefill)
    fitted = {"step_base_s": coef[0], "step_per_seq_s": coef[1], "step_per_kv_token_s": coef[2],
              "prefill_per_token_s": per_token}  # fmt: skip
    report = {"slices": len(rows), "mean_slice_s": sum(y) / len(y), "rms_error_s": rms, "scale": scale,
              "round_trip_s": gap, "prefills": len(prefill)}  # fmt: skip
    return fitted, report


def _steady_start(events: list[dict[str, Any]]) -> float:
    """The end of the run's first optimizer step: what comes before pays first loads, cold engines and
    the first evaluation; 0 when the run never stepped (everything is used then)."""
    steps = [e for e in events if e["role"] == "train" and e["name"].startswith("step ")]
    if not steps:
        return 0.0
    first = min(steps, key=lambda e: e["start"])["name"]
    return max(e["end"] for e in steps if e["name"] == first)


def _cv(ratios: list[float]) -> float:
    """Coefficient of variation of durations given as ratios to their own expected seconds (0 for fewer
    than two)."""
    if len(ratios) < 2:
        return 0.0
    mean = fmean(ratios)
    return pstdev(ratios) / mean if mean > 0 else 0.0


def _shift_spread(events: list[dict[str, Any]], steady: float, shifts: dict[str, float]) -> float:
    """The spread of the steady shifts (first loads aside), each against the mean of its own pair."""
    ratios = [
        (e["end"] - e["start"]) / shifts[e["name"]]
        for e in events
        if e["role"] == "shift" and e["start"] >= steady and shifts.get(e["name"], 0) > 0
    ]
    return _cv(ratios)


def _shift_seconds(events: list[dict[str, Any]], steady: float) -> tuple[dict[str, float], list[str]]:
    """Every ordered pair of roles and the refresh, each the mean of its spans after ``steady``.

    First loads (``none->role``) are left out: they include starting the process and the engine,
    paid once in the first step. A pair the steady window never saw takes, in order, the mean of
    its spans from the first step, of the steady shifts into the same role, of all steady shifts
    between two roles, or of the first loads into the role (an upper bound): each one named in the
    returned list of fallbacks. An unmeasured refresh is left out (``MeasuredCosts.refresh``)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e["role"] == "shift":
            spans.setdefault(e["name"], []).append((e["start"], e["end"] - e["start"]))

    def mean_of(keys: list[str], steady_only: bool) -> float | None:
        v = [sec for k in keys for start, sec in spans.get(k, []) if start >= steady or not steady_only]
        return fmean(v) if v else None

    out: dict[str, float] = {}
    fallbacks: list[str] = []
    for key in (*REQUIRED_SHIFTS, REFRESH):
        dst = key.split("->")[1]
        into = [k for k in REQUIRED_SHIFTS if k.endswith(f"->{dst}")]
        tries = [("measured", mean_of([key], True)), ("measured in the first step", mean_of([key], False))]
        if key != REFRESH:
            tries += [
                (f"mean shift into {dst}", mean_of(into, True)),
                ("mean shift", mean_of(list(REQUIRED_SHIFTS), True)),
                (f"first loads into {dst}", mean_of([f"none->{dst}"], False)),
            ]
        value = next(((how, v) for how, v in tries if v is not None), None)
        if value is None:
            if key == REFRESH:
                continue
            raise ValueError(f"shift {key}: no shift spans in events.jsonl to measure it or fall back on")
        out[key] = value[1]
        if value[0] != "measured":
            fallbacks.append(f"shift {key}: {value[0]}")
    return out, fallbacks


def _fit_train(
    events: list[dict[str, Any]], steady: float, prompt: float
) -> tuple[TrainMeasure, dict[str, float], dict[str, Any]]:
    """Accumulate spans give ``seconds = per_call + per_token * tokens`` (least squares; tokens count
    each sample's prompt, as the simulator does, though the spans log response tokens only), scaled
    so that the line adds up to the measured time of all the spans. The call term is fitted only
    when the calls' sizes differ at least twofold; else it cannot be told from the token term and is
    0 (seconds over tokens). The optimizer step is the mean over steps of the time from the last
    device joining it to the last one leaving. Also the spread of each (``SPREAD_KINDS``): of the
    spans about the line, and of the optimizer steps about their mean."""
    acc = [e for e in events if e["role"] == "train" and e["name"].startswith("accumulate")]
    acc = [e for e in acc if e["start"] >= steady] or acc
    if not acc or any("tokens" not in e["args"] or "samples" not in e["args"] for e in acc):
        raise ValueError("no accumulate spans with samples and tokens in events.jsonl")
    tokens = [e["args"]["tokens"] + e["args"]["samples"] * prompt for e in acc]
    seconds = [e["end"] - e["start"] for e in acc]
    per_call, per_token = 0.0, sum(seconds) / sum(tokens)
    if max(tokens) >= 2 * min(tokens):
        per_call, per_token = nonneg_least_squares([(1.0, t) for t in tokens], seconds)
        # least squares weighs every call alike, so the line need not add up: a few big calls that
        # ran slow (devices sharing their cores) are under-read by the many small ones
        scale = sum(seconds) / sum(per_call + per_token * t for t in tokens)
        per_call, per_token = per_call * scale, per_token * scale
    ratios = [sec / (per_call + per_token * t) for sec, t in zip(seconds, tokens, strict=True)]
    steps: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e["role"] == "train" and e["name"].startswith("step "):
            steps.setdefault(e["name"], []).append(e)
    groups = [g for g in steps.values() if min(e["start"] for e in g) >= steady] or list(steps.values())
    if not groups:
        raise ValueError("no optimizer step spans in events.jsonl")
    spans = [max(e["end"] for e in g) - max(e["start"] for e in g) for g in groups]
    optimizer = fmean(spans)
    spreads = {"accumulate": _cv(ratios), "optimizer": _cv(spans)}
    report = {"accumulates": len(acc), "optimizer_steps": len(groups)}
    return TrainMeasure(per_token, optimizer, per_call), spreads, report


def replay_overrides(run_dir: str | Path, fit: RunFit) -> list[str]:
    """The ``sim.*`` overrides that make ``pivotrl simulate`` with ``fit``'s costs run the job of ``run_dir``
    (given its ``config.json``): as many instances as it had devices, its prompts as long as its engines
    prefilled them, the judge's prompt beside the prompt and the response,
    its judgments' length (``metrics.jsonl``) and its slice cadence. Those the run's files do not tell are
    left out (the job's config gives them)."""
    out = []
    if isinstance(devices := fit.report.get("devices"), int):  # (one instance of one GPU a device, as measured)
        out.append(f"sim.gpus={devices}")
    prompt, judge_prompt = (fit.report.get(role, {}).get("prompt_tokens") for role in ("rollout", "judge"))
    if prompt:
        out.append(f"sim.prompt_len={max(1, round(prompt))}")
    path = Path(run_dir) / "metrics.jsonl"
    read = read_jsonl(path) if path.is_file() else []
    rows = [r for _, r in read if all(isinstance(r.get(k), int | float) for k in _REPLAYED)]
    samples = sum(r["response_tokens"] / r["response_length"] for r in rows if r["response_length"] > 0)
    if samples:
        response = sum(r["response_tokens"] for r in rows) / samples
        if prompt and judge_prompt:
            out.append(f"sim.judge_template_len={max(0, round(judge_prompt - prompt - response))}")
        out.append(f"sim.judge_output_len={max(1, round(sum(r['judge_tokens'] for r in rows) / samples))}")
    out.append(f"sim.slice_s={fit.slice_s:.4f}")
    return out


def write_length_trace(run_dir: str | Path, path: str | Path) -> int:
    """Each response's length, by step and sample, from ``run_dir``'s ``samples.jsonl`` into a length trace at
    ``path`` (``sim.lengths_file`` with ``sim.lengths_replay=true`` replays it, each sample its own); the rows
    written (0: nothing to replay, no file written)."""
    source = Path(run_dir) / "samples.jsonl"
    if not source.is_file():
        return 0
    rows = [json.dumps({"step": row["step"], "uid": row["uid"], "length": len(row["response_ids"])})
            for _, row in read_jsonl(source)
            if isinstance(row.get("response_ids"), list) and "step" in row and "uid" in row]  # fmt: skip
    if rows:
        Path(path).write_text("\n".join(rows) + "\n")
    return len(rows)


_REPLAYED = ("response_tokens", "response_length", "judge_tokens")


def fit_run(run_dir: str | Path) -> RunFit:
    """Fit a ``MeasuredCosts`` to a run directory of the real runtime (its ``config.json`` and
    ``events.jsonl``), with the run's slice cadence.

    Only the steady state counts: the spans after the end of the first optimizer step (the first
    step pays the first loads, cold engines and the start-of-run evaluation). Every cost is a mean
    over it (adding up to the measured time of the spans it is fitted to), so that the simulated
    step compares with the mean measured step. Decode: the line above (``_fit_generation``).
    Prefill: seconds over tokens of the timed prefills. Training and the optimizer step:
    ``_fit_train``. Shifts: ``_shift_seconds``. The spread of shifts, backward calls and optimizer
    steps about those means (``MeasuredCosts.spreads``): the simulator draws each one's seconds
    with it, so that a step waiting on the slowest of several pays what the run paid. Raises
    ``ValueError`` naming the run directory and what is missing or wrong (a line of a run file that is not
    JSON: ``telemetry.read_jsonl``'s ``UserError``, naming the file).
    """
    try:
        return _fit_run(run_dir)
    except ValueError as e:
        raise ValueError(f"{run_dir}: {e}") from None


def _fit_run(run_dir: str | Path) -> RunFit:
    config, events = _read_run(run_dir)
    max_batch = _config_int(config, "rollout", "max_batch")
    cap = max(_config_int(config, "rollout", "max_new_tokens"), _config_int(config, "eval", "max_new_tokens"))
    judge_cap = 2 * _config_int(config, "rollout", "max_new_tokens") + _config_int(config, "judge", "max_new_tokens")
    steady = _steady_start(events)
    slices, skipped = _replay(events, max_batch)
    gen: dict[str, GenMeasure] = {}
    report: dict[str, Any] = {"steady_from_s": steady, "replay_out_of_step": skipped, "devices": config.get("devices")}
    prompt: dict[str, float] = {}
    names = [
        Path(str(config[k].get("path", ""))).name if isinstance(config.get(k), dict) else ""
        for k in ("policy", "judge")
    ]
    names = [n or k for n, k in zip(names, ("policy", "judge"), strict=True)]
    names = names if names[0] != names[1] else ["policy", "judge"]
    for role, name, longest in zip(GEN_ROLES, names, (cap, judge_cap), strict=True):
        line, report[role] = _fit_generation(slices, role, steady)
        fresh = [g for g in slices if g.role == role and g.admitted > 0 and g.prefill_tokens > 0]
        if not fresh:
            raise ValueError(f"no {role} slice admitted sequences: the prompt length is unknown")
        admitted = sum(g.admitted for g in fresh)
        prompt[role] = report[role]["prompt_tokens"] = sum(g.prefill_tokens for g in fresh) / admitted
        # the KV slot the runtime sizes: prompt plus the output limits (ContextSpec)
        gen[role] = GenMeasure(name, **line, max_batch=max_batch, max_len=math.ceil(prompt[role]) + longest)
    train, spreads, report["train"] = _fit_train(events, steady, prompt["rollout"])
    shifts, report["fallbacks"] = _shift_seconds(events, steady)
    spreads["shift"] = _shift_spread(events, steady, shifts)
    mode, devices = config.get("mode", "?"), config.get("devices", "?")
    device = f"fitted to {Path(run_dir).name}: {mode} on {devices} device(s)"
    costs = MeasuredCosts(gen["rollout"], gen["judge"], train, shifts, device, {k: spreads[k] for k in SPREAD_KINDS})
    period = [g.end - g.start + g.gap_s for g in slices if g.gap_s is not None and g.start >= steady]
    slice_s = median(period) if period else median([g.end - g.start for g in slices])
    return RunFit(costs, slice_s, report)
