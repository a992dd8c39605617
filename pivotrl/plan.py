"""``pivotrl plan``: the planner's view of a job before running it.

It builds the workload of one whole step from the config (and, given a
finished run, the lengths and throughputs that run measured) and estimates
the step as the job's mode would run it: shiftable, for every start split of
the devices, the recommended one first; disaggregated, for the split given
(or the default one) and the other static splits, no device changing role;
colocated, every device in every phase. A phase that never ends (no device
for it) makes the split infeasible, not infinitely slow. Pure logic, no
devices touched.

It also prints what a train device would hold of the policy (``policy.path``'s
config.json), by trainer and number of train devices at the optimizer step, in
the compute dtype a GPU runs (``pivotrl.train.memory``'s arithmetic), and with
``device_gb`` the fewest train devices each trainer fits on: what
``train.min_devices`` should be. Last, the job as it resolves on such GPUs
(``pivotrl.resolve``): the trainer, the models' dtypes and backends, and
with ``device_gb`` what a device's share of a GPU must hold
(``gpus_per_device``); a share too small is refused as a run refuses it.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

from pivotrl.config import JobConfig, parse_split
from pivotrl.control.messages import ROLES, Role
from pivotrl.control.modes import Disaggregated, make_policy
from pivotrl.control.planner import Estimate, Profiles, ShiftCosts, Workload, estimate, fmt_alloc, initial_split
from pivotrl.control.shiftable import Shiftable
from pivotrl.errors import UserError
from pivotrl.model.config import ModelConfig, UnsupportedModelError
from pivotrl.resolve import DTYPE_BYTES, GB, PROMPT_BOUND, VLLM, Hardware, describe, resolve, sequence_lengths
from pivotrl.runtime.devices import CUDA
from pivotrl.sim.hardware import GPU, GPUS
from pivotrl.sim.models import ModelSpec
from pivotrl.sim.priors import roofline_priors
from pivotrl.sizing import describe as describe_sizing
from pivotrl.sizing import sizing
from pivotrl.telemetry import read_jsonl
from pivotrl.train import memory
from pivotrl.train.traits import NAMES

_METRICS = ("response_tokens", "response_length", "judge_tokens", "time_s/train")  # (nested keys by "/")


def _rows(file: Path) -> list[tuple[int, dict[str, Any]]]:
    if not file.is_file():
        raise UserError(f"--profile: {file} not found (a run directory of `pivotrl train` has one)")
    return read_jsonl(file)


def _number(file: Path, n: int, row: dict[str, Any], *keys: str) -> float:
    value: Any = row
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"--profile: {file} line {n}: no number at {'.'.join(keys)!r}")
    return float(value)


def measured(run_dir: Path) -> dict[str, float]:
    """Means and per-role throughputs of a finished run (metrics.jsonl + events.jsonl)."""
    file = run_dir / "metrics.jsonl"
    metrics = [{key: _number(file, n, m, *key.split("/")) for key in _METRICS} for n, m in _rows(file)]
    if not metrics:
        raise UserError(f"--profile: {file} has no steps (did the run finish one?)")
    n = sum(m["response_tokens"] / m["response_length"] for m in metrics if m["response_length"])
    out = {
        "response_tokens": sum(m["response_tokens"] for m in metrics) / max(n, 1),
        "judge_tokens": sum(m["judge_tokens"] for m in metrics) / max(n, 1),
        "step_seconds": sum(m["time_s/train"] for m in metrics) / len(metrics),
    }
    busy: dict[str, float] = {}
    events = run_dir / "events.jsonl"
    for line, e in _rows(events):
        role = e.get("role")
        if not isinstance(role, str):
            raise UserError(f"--profile: {events} line {line}: no 'role'")
        busy[role] = busy.get(role, 0.0) + _number(events, line, e, "end") - _number(events, line, e, "start")
    tokens = {"rollout": sum(m["response_tokens"] for m in metrics), "judge": sum(m["judge_tokens"] for m in metrics)}
    for role, t in tokens.items():
        if busy.get(role):
            out[f"{role}_rate"] = t / busy[role]
    return out


def _architecture(path: str) -> ModelConfig:
    file = Path(path) / "config.json"
    try:
        return ModelConfig.from_hf(json.loads(file.read_text()))
    except (OSError, ValueError, KeyError, UnsupportedModelError) as e:
        raise ValueError(f"cannot read {str(file)!r} ({e})") from None


def train_memory(cfg: JobConfig, device_gb: float | None = None) -> dict[str, Any]:
    """Bytes a train device holds of the policy, by trainer and train devices at the step (1, 2, 4, ... and
    every device), in GB; with ``device_gb``, the fewest train devices each trainer fits on (None: none), and
    what a device's share of such a GPU must hold (the judge's part where ``judge.path`` is readable; prompts of
    at most ``PROMPT_BOUND`` tokens, as a run bounds them before it measures its own)."""
    try:
        config = _architecture(cfg.policy.path)
    except ValueError as e:
        return {"error": f"policy.path: {e}"}
    judge_error = ""
    try:
        judge: ModelConfig | None = _architecture(cfg.judge.path)
    except ValueError as e:
        judge, judge_error = None, f"judge.path: {e}"
    vllm = importlib.util.find_spec("vllm") is not None  # (what auto's backends take: vLLM where it is installed)
    hw = Hardware.of(cfg, CUDA, None if device_gb is None else device_gb * 1e9, vllm=vllm)
    rollout_len, judge_len = sequence_lengths(cfg)
    plan = resolve(cfg, hw, config, judge=judge, judge_max_len=judge_len, rollout_max_len=rollout_len)
    c, tokens, checkpointed = plan.compute_bytes, cfg.train.planned_tokens, plan.activation_checkpointing
    backend = plan.trainer.value
    worlds = sorted({2**i for i in range(cfg.devices.bit_length()) if 2**i <= cfg.devices} | {cfg.devices})
    out: dict[str, Any] = {
        "parameters": config.num_parameters(),
        "compute_bytes": c,
        "micro_batch_tokens": tokens,
        "activation_checkpointing": checkpointed,
        "checkpointing_auto": cfg.train.activation_checkpointing == "auto",
        "backend": backend,
        "backend_auto": cfg.train.backend == "auto",
        "worlds": worlds,
        "per_device_gb": {
            t: [memory.per_device(config, t, w, tokens, c, checkpointed) / 1e9 for w in worlds] for t in NAMES
        },
        "plan": plan.to_dict(),
    }
    if judge_error:
        out["judge_error"] = judge_error
    if device_gb is not None:
        assert hw.device_bytes is not None
        out["device_gb"] = device_gb
        out["fewest_devices"] = {
            t: memory.fewest_devices(config, t, hw.device_bytes, cfg.devices, tokens, c, checkpointed) for t in NAMES
        }
        engines = sizing(
            cfg,
            hw.device_bytes,
            {"rollout": config, "judge": judge},
            {"rollout": plan.rollout_dtype, "judge": plan.judge_dtype},
            {"rollout": plan.rollout_backend, "judge": plan.judge_backend},
            {"rollout": rollout_len, "judge": judge_len},
        )
        out["sizing"] = engines.to_dict(plan.tensor_parallel, cfg.tensor_parallel == "auto")
        if judge_error:
            out["sizing"]["unsized"] = judge_error
        if plan.share is not None:
            out["sizing"]["train"] = {
                "trainer": backend,
                "share_gb": plan.share.train / GB,
                "devices": cfg.devices,
                "fewest": out["fewest_devices"][backend],
                "instances": plan.min_train_devices,
            }
        if plan.too_big:  # (train.min_devices=auto then stops a run: why)
            out["too_big"] = plan.too_big
        if plan.too_small:  # (a run stops on it)
            out["too_small"] = plan.too_small
    return out


def plan_report(cfg: JobConfig, run_dir: Path | None = None, top: int = 5, device_gb: float | None = None,
                gpu: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The job's step as the mode runs it: shiftable, the best start split (devices move from there);
    disaggregated, the split given or the default one, which no device leaves, and the best such splits;
    colocated, every device in every phase. A layout the mode refuses is refused here as ``train`` does. The
    control plane's devices are the plan's instances. The step is priced by ``run_dir``'s measurements where given,
    else on the roofline of the GPU ``gpu`` names (or ``device_gb`` suggests) for the models the job names, else
    by the planner's CPU priors; ``gpu`` alone gives the devices its memory."""
    r = cfg.rollout
    modeled = model_gpu(gpu, device_gb)
    if device_gb is None and modeled is not None:
        device_gb = round(modeled.hbm_bytes / GB, 1)
    memory_report = train_memory(cfg, device_gb)
    min_train = memory_report["plan"]["min_train_devices"] if "plan" in memory_report else max(1, cfg.train.min_devices)
    if not cfg.train.min_devices and "too_big" in memory_report:  # (auto, as a run on such GPUs takes it)
        raise UserError(f"train.min_devices=auto: {memory_report['too_big']}")
    if "too_small" in memory_report:
        raise UserError(memory_report["too_small"])
    tp = memory_report["plan"]["tensor_parallel"] if "plan" in memory_report else _given_tp(cfg)
    devices = cfg.devices // tp
    try:
        layout = make_policy(cfg.mode, devices, _instances(cfg, tp), r.max_batch, r.max_new_tokens,
                             cfg.judge.max_new_tokens, r.prompts_per_step * r.group_size, min_train)  # fmt: skip
    except ValueError as e:
        unit = f" (counted in instances of tensor_parallel={tp} devices)" if tp > 1 else ""
        raise UserError(f"{e}{unit}") from None
    # (the planner's priors, whatever the mode: the shiftable policy holds them)
    profiles: Profiles = Shiftable(devices, r.max_batch, r.max_new_tokens, cfg.judge.max_new_tokens).profiles
    seqs = r.prompts_per_step * r.group_size
    resp, judge, step_s = r.max_new_tokens / 2, cfg.judge.max_new_tokens / 2, 0.1
    source, pricing = "priors", ""
    if run_dir is not None:
        m = measured(run_dir)
        resp, judge, step_s, source = m["response_tokens"], m["judge_tokens"], m["step_seconds"], str(run_dir)
        pricing = f"the lengths and rates {run_dir} measured (the planner's CPU priors where it measured none)"
        for _ in range(64):
            profiles.lengths.observe(max(1, round(resp)))
        if "rollout_rate" in m:
            profiles.rollout.observe(round(m["rollout_rate"]), 1.0, r.max_batch)
        if "judge_rate" in m:
            profiles.judge.observe(round(m["judge_rate"]), 1.0, r.max_batch)
    else:
        priced, pricing = _roofline(cfg, profiles, modeled, device_gb, memory_report)
        if priced is not None:
            source, step_s = "roofline", priced
    work = Workload(
        rollout_remaining=[0] * seqs,
        judge_future=seqs,
        judge_tokens_mean=judge,
        train_groups_left=r.prompts_per_step,
        train_tokens_per_group=0.0,  # (every response is still to generate: the planner expects their lengths)
        step_seconds=step_s,
        train_devices_needed=min_train,
    )
    report: dict[str, Any] = {"devices": cfg.devices, "tensor_parallel": tp, "mode": cfg.mode, "source": source,
                              "max_staleness": cfg.max_staleness,
                              "pricing": pricing}  # fmt: skip
    if isinstance(layout, Disaggregated):
        profiles.costs = ShiftCosts(prior=math.inf)  # (no device leaves its role: a shift would never end)
        allocs = [
            {Role.ROLLOUT: n_r, Role.JUDGE: n_g, Role.TRAIN: devices - n_r - n_g}
            for n_r in range(1, devices)
            for n_g in range(1, devices - n_r - min_train + 1)
        ]
        rows = sorted((estimate(work, profiles, a, r.max_batch) for a in allocs), key=lambda e: e.total)
        split = estimate(work, profiles, layout.split, r.max_batch)
        report |= {
            "split": {role.value: n * tp for role, n in layout.split.items()},  # (in devices, as split= counts)
            "split_given": bool(cfg.split.strip()),
            "timeline": _row(split),
            "recommended": {role.value: rows[0].count(role) * tp for role in ROLES},
            "estimates": [_row(e) for e in rows[:top]],
        }
    elif cfg.mode == "colocated":  # every device in every phase: all of them roll out, then judge, then train
        report["timeline"] = _row(estimate(work, profiles, {Role.ROLLOUT: devices}, r.max_batch))
    else:
        best = initial_split(work, profiles, devices, r.max_batch)
        rows = []
        for n_r in range(devices + 1):
            for n_g in range(devices + 1 - n_r):
                alloc = {Role.ROLLOUT: n_r, Role.JUDGE: n_g, Role.TRAIN: devices - n_r - n_g}
                rows.append(estimate(work, profiles, alloc, r.max_batch))
        rows.sort(key=lambda e: e.total)
        report["recommended"] = {role.value: best[role] * tp for role in ROLES}
        report["estimates"] = [_row(e) for e in rows[:top]]
    report["train_memory"] = memory_report
    report["min_train_devices"] = min_train
    return report


def model_gpu(name: str | None, device_gb: float | None) -> GPU | None:
    """The modeled GPU (``pivotrl.sim.hardware.GPUS``) a step is priced on: ``name`` in any case (``--gpu``), else
    the first whose memory is within a tenth of ``device_gb`` (80: the H100, as datasheets and nvidia-smi round
    it); None where neither names one."""
    if name is not None:
        found = {k.lower(): g for k, g in GPUS.items()}.get(name.lower())
        if found is None:
            raise UserError(f"--gpu: got {name!r}; allowed: {', '.join(GPUS)} (the GPUs pivotrl.sim models)")
        return found
    if device_gb is None:
        return None
    return next((g for g in GPUS.values() if abs(device_gb / (g.hbm_bytes / 2**30) - 1) <= 0.1), None)


def _given_tp(cfg: JobConfig) -> int:
    """The instance size where the job is not resolved (no policy shape): as given, auto's answer on CPUs (1)."""
    return 1 if cfg.tensor_parallel == "auto" else cfg.tensor_parallel


def _instances(cfg: JobConfig, tp: int) -> dict[str, int]:
    """``split`` in instances of ``tp`` devices (it counts devices): a role holds whole instances."""
    split = parse_split(cfg.split)
    for role, count in split.items():
        if count % tp:
            raise UserError(
                f"split: {role}:{count} is not a whole number of instances of tensor_parallel={tp} devices "
                f"(tensor_parallel={cfg.tensor_parallel}): use a multiple of {tp}"
            )
    return {role: count // tp for role, count in split.items()}


CPU_PRIORS = "the planner's CPU priors (the bundled job's: one CPU thread on its tiny models), not the models named"


def _roofline(cfg: JobConfig, profiles: Profiles, gpu: GPU | None, device_gb: float | None, m: dict[str, Any]
              ) -> tuple[float | None, str]:  # fmt: skip
    """``profiles`` priced on ``gpu``'s roofline for the job's models, as resolved in ``m`` (``train_memory``'s
    report): the optimizer step's seconds and what priced the step; (None, why not) where it cannot be."""
    if gpu is None:
        why = (
            "--gpu NAME or --device-memory-gb GB prices it on a GPU's roofline"
            if device_gb is None
            else f"no modeled GPU has {device_gb:g} GB: --gpu NAME ({', '.join(GPUS)}) names one"
        )
        return None, f"{CPU_PRIORS}; {why}"
    if "error" in m or "judge_error" in m:
        return None, f"{CPU_PRIORS}; the roofline needs both models' shapes: {m.get('error') or m['judge_error']}"
    plan = m["plan"]
    tp, policy, judge = plan["tensor_parallel"], _architecture(cfg.policy.path), _architecture(cfg.judge.path)
    try:
        models = (
            ModelSpec.from_config(policy, "policy", DTYPE_BYTES[plan["rollout_dtype"]]),
            ModelSpec.from_config(judge, "judge", DTYPE_BYTES[plan["judge_dtype"]]),
        )
    except ValueError as e:
        return None, f"{CPU_PRIORS}; the roofline cannot model these shapes ({e})"
    paged = plan["rollout_backend"] == plan["judge_backend"] == VLLM
    costs = roofline_priors(cfg, profiles, gpu, models, tp, prompt=PROMPT_BOUND, contexts=sequence_lengths(cfg),
                            checkpointed=plan["activation_checkpointing"], paged=paged)  # fmt: skip
    step = costs.optimizer_step(models[0], plan["min_train_devices"] * tp)
    return step, (
        f"the roofline of {gpu.name} GPUs (pivotrl.sim.costs) for the {policy.num_parameters() / 1e9:.2f}B policy "
        f"in {plan['rollout_dtype']} and the {judge.num_parameters() / 1e9:.2f}B judge in {plan['judge_dtype']}, "
        f"instances of {tp}: decode, prefill, training, shifts and the optimizer step; prompts of "
        f"{PROMPT_BOUND} tokens, responses and judgments half their limits"
    )


def _seconds(x: float) -> float | None:
    return x if math.isfinite(x) else None  # (JSON has no infinity: a phase that never ends is null)


def _row(e: Estimate) -> dict[str, Any]:
    phases = {"rollout": e.rollout_end, "judge": e.judge_end, "backward": e.backward_end, "step": e.total}
    return {
        "split": fmt_alloc(e.alloc),
        "timeline": _timeline(e),
        "seconds": _seconds(e.total),
        "phases": {k: _seconds(v) for k, v in phases.items()},
    }


def _timeline(e: Estimate) -> str:
    """``r2 j1 t1: rollout 1.68s judge 2.73s ...``, or why the step never completes with that split."""
    if math.isfinite(e.total):
        return e.describe()
    if not math.isfinite(e.rollout_end):
        why = "no device generates"
    elif not math.isfinite(e.judge_end):
        why = "no device judges"
    elif not math.isfinite(e.backward_end):
        why = "no device trains"
    else:
        why = "too few train devices for the optimizer step (train.min_devices)"
    return f"{fmt_alloc(e.alloc)}: infeasible, the step never completes ({why})"


def format_report(report: dict[str, Any]) -> str:
    tp = report.get("tensor_parallel", 1)
    instances = f" ({report['devices'] // tp} instances of {tp})" if tp > 1 else ""
    lines = [
        f"devices: {report['devices']}{instances}   mode: {report['mode']}",
        f"step priced by {report['pricing']}" if report.get("pricing") else f"profile: {report['source']}",
    ]
    if tp > 1:
        lines.append(f"(the control plane's devices are instances: r, j and t below count instances of {tp} devices)")
    if report["mode"] == "disaggregated":
        split = ",".join(f"{k}:{v}" for k, v in report["split"].items())
        given = "as given" if report["split_given"] else "the default; split= sets another"
        lines += [
            f"split: {split} ({given}); no device changes role",
            f"expected step (phases end at):  {report['timeline']['timeline']}",
            "best splits (split=rollout:R,judge:G,train:T):",
        ]
        lines += [f"  {e['timeline']}" for e in report["estimates"]]
    elif report["mode"] == "colocated":
        timeline = report["timeline"]["timeline"].partition(": ")[2]
        lines.append(f"every device generates, then judges, then trains (phases end at): {timeline}")
    else:
        rec = report["recommended"]
        lines += [
            "recommended start split: " + ", ".join(f"{k}:{v}" for k, v in rec.items()),
            "expected step (best start splits, devices moving between roles from there; phases end at):",
        ]
        lines += [f"  {e['timeline']}" for e in report["estimates"]]
    if report.get("max_staleness"):
        lines.append(
            f"max_staleness={report['max_staleness']}: steps overlap, and the estimate above is of one step on-policy "
            "(an upper bound on the time between updates); `pivotrl simulate` runs the overlap"
        )
    lines += _memory_lines(report["train_memory"])
    if "plan" in report["train_memory"]:
        lines += describe(report["train_memory"]["plan"])
    if "sizing" in report["train_memory"]:
        lines += describe_sizing(report["train_memory"]["sizing"], PROMPT_BOUND)
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _auto(m: dict[str, Any]) -> str:
    """How train.activation_checkpointing=auto came to its value here (the job decides it once for its devices)."""
    if not m["checkpointing_auto"]:
        return ""
    return (
        " (auto, for these devices)"
        if "device_gb" in m
        else " (auto: decided for the devices a run finds; --device-memory-gb)"
    )


def _memory_lines(m: dict[str, Any]) -> list[str]:
    if "error" in m:
        return [f"train memory: not estimated, {m['error']}"]
    dtype = {2: "bf16", 4: "fp32"}[m["compute_bytes"]]
    lines = [
        f"train memory per device at the optimizer step, GB (arithmetic: {_count(m['parameters'])} parameters, "
        f"{dtype} compute, {m['micro_batch_tokens']}-token micro batches, activation checkpointing "
        f"{'on' if m['activation_checkpointing'] else 'off'}{_auto(m)}):",
        "  train devices " + "".join(f"{w:>8}" for w in m["worlds"]),
    ]
    for t, row in m["per_device_gb"].items():
        mark = " *" if t == m["backend"] else ""
        lines.append(f"  {t + mark:<13} " + "".join(f"{x:>8.1f}" if x >= 10 else f"{x:>8.2f}" for x in row))
    if m["backend_auto"]:
        lines.append("  (* what train.backend=auto takes for this job on such GPUs)")
    else:
        lines.append(f"  (* train.backend={m['backend']}, as configured)")
    if "fewest_devices" in m:
        fewest = m["fewest_devices"]
        fits = ", ".join(f"{t} {n if n else 'none of ' + str(m['worlds'][-1])}" for t, n in fewest.items())
        lines.append(f"  fewest train devices that fit {m['device_gb']:g} GB: {fits}")
        if fewest[m["backend"]]:
            lines.append(f"  -> train.min_devices=auto takes {fewest[m['backend']]} on such devices ({m['backend']})")
    return lines
