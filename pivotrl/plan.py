"""``pivotrl plan``: the planner's view of a job before running it.

It builds the workload of one whole step from the config (and, given a
finished run, the lengths and throughputs that run measured), estimates the
step for every split of the devices, and prints the recommended start split
with its expected timeline. Pure logic, no devices touched.

It also prints what a train device would hold of the policy (``policy.path``'s
config.json), by trainer and number of train devices at the optimizer step, in
the compute dtype a GPU runs (``pivotrl.train.memory``'s arithmetic), and with
``device_gb`` the fewest train devices each trainer fits on: what
``train.min_devices`` should be.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pivotrl.config import JobConfig
from pivotrl.control.messages import ROLES, Role
from pivotrl.control.planner import Profiles, Workload, estimate, fmt_alloc, initial_split
from pivotrl.control.shiftable import Shiftable
from pivotrl.model.config import ModelConfig, UnsupportedModelError
from pivotrl.runtime.devices import CUDA, shares_gpu
from pivotrl.train import memory


def measured(run_dir: Path) -> dict[str, float]:
    """Means and per-role throughputs of a finished run (metrics.jsonl + events.jsonl)."""
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if not metrics:
        raise ValueError(f"{run_dir}: metrics.jsonl has no steps")
    n = sum(m["response_tokens"] / m["response_length"] for m in metrics if m["response_length"])
    out = {
        "response_tokens": sum(m["response_tokens"] for m in metrics) / max(n, 1),
        "judge_tokens": sum(m["judge_tokens"] for m in metrics) / max(n, 1),
        "step_seconds": sum(m["time_s"]["train"] for m in metrics) / len(metrics),
    }
    busy: dict[str, float] = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        busy[e["role"]] = busy.get(e["role"], 0.0) + e["end"] - e["start"]
    tokens = {"rollout": sum(m["response_tokens"] for m in metrics), "genrm": sum(m["judge_tokens"] for m in metrics)}
    for role, t in tokens.items():
        if busy.get(role):
            out[f"{role}_rate"] = t / busy[role]
    return out


def train_memory(cfg: JobConfig, device_gb: float | None = None) -> dict[str, Any]:
    """Bytes a train device holds of the policy, by trainer and train devices at the step (1, 2, 4, ... and
    every device), in GB; with ``device_gb``, the fewest train devices each trainer fits on (None: none)."""
    file = Path(cfg.policy.path) / "config.json"
    try:
        config = ModelConfig.from_hf(json.loads(file.read_text()))
    except (OSError, ValueError, KeyError, UnsupportedModelError) as e:
        return {"error": f"policy.path: cannot read {str(file)!r} ({e})"}
    c, tokens = cfg.train.compute_bytes(CUDA), cfg.train.planned_tokens
    shared = shares_gpu(CUDA, cfg.gpus_per_device, cfg.devices)  # (then ZeRO-1, each device on its share)
    device_bytes = None if device_gb is None else device_gb * 1e9 * min(1.0, cfg.gpus_per_device)
    backend = cfg.train_backend(config, CUDA, shared, device_bytes)
    checkpointed = cfg.train.resolved_checkpointing(config, backend, cfg.devices, device_bytes, CUDA)
    worlds = sorted({2**i for i in range(cfg.devices.bit_length()) if 2**i <= cfg.devices} | {cfg.devices})
    out: dict[str, Any] = {
        "parameters": config.num_parameters(),
        "compute_bytes": c,
        "micro_batch_tokens": tokens,
        "activation_checkpointing": checkpointed,
        "checkpointing_auto": cfg.train.activation_checkpointing == "auto",
        "backend": backend,
        "worlds": worlds,
        "per_device_gb": {
            t: [memory.per_device(config, t, w, tokens, c, checkpointed) / 1e9 for w in worlds] for t in memory.TRAINERS
        },
    }
    if device_gb is not None:
        out["device_gb"] = device_gb
        out["fewest_devices"] = {
            t: memory.fewest_devices(config, t, device_bytes, cfg.devices, tokens, c, checkpointed)
            for t in memory.TRAINERS
        }
    return out


def plan_report(cfg: JobConfig, run_dir: Path | None = None, top: int = 5, device_gb: float | None = None
                ) -> dict[str, Any]:  # fmt: skip
    policy = Shiftable(cfg.devices, cfg.rollout.max_batch, cfg.rollout.max_new_tokens, cfg.judge.max_new_tokens)
    profiles: Profiles = policy.profiles
    seqs = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    resp, judge, step_s = cfg.rollout.max_new_tokens / 2, cfg.judge.max_new_tokens / 2, 0.1
    source = "priors"
    if run_dir is not None:
        m = measured(run_dir)
        resp, judge, step_s, source = m["response_tokens"], m["judge_tokens"], m["step_seconds"], str(run_dir)
        for _ in range(64):
            profiles.lengths.observe(max(1, round(resp)))
        if "rollout_rate" in m:
            profiles.rollout.observe(round(m["rollout_rate"]), 1.0, cfg.rollout.max_batch)
        if "genrm_rate" in m:
            profiles.judge.observe(round(m["genrm_rate"]), 1.0, cfg.rollout.max_batch)
    work = Workload(
        rollout_remaining=[0] * seqs,
        judge_future=seqs,
        judge_tokens_mean=judge,
        train_groups_left=cfg.rollout.prompts_per_step,
        train_tokens_per_group=resp * cfg.rollout.group_size,
        step_seconds=step_s,
    )
    best = initial_split(work, profiles, cfg.devices, cfg.rollout.max_batch)
    rows = []
    for r in range(cfg.devices + 1):
        for g in range(cfg.devices + 1 - r):
            alloc = {Role.ROLLOUT: r, Role.GENRM: g, Role.TRAIN: cfg.devices - r - g}
            rows.append(estimate(work, profiles, alloc, cfg.rollout.max_batch))
    rows.sort(key=lambda e: e.total)
    return {
        "devices": cfg.devices,
        "source": source,
        "recommended": {r.value: best[r] for r in ROLES},
        "estimates": [{"split": fmt_alloc(e.alloc), "timeline": e.describe(), "seconds": e.total} for e in rows[:top]],
        "train_memory": train_memory(cfg, device_gb),
    }


def format_report(report: dict[str, Any]) -> str:
    rec = report["recommended"]
    lines = [
        f"devices: {report['devices']}   profile: {report['source']}",
        "recommended start split: " + ", ".join(f"{k}:{v}" for k, v in rec.items()),
        "expected step (best splits, phases end at):",
    ]
    lines += [f"  {e['timeline']}" for e in report["estimates"]]
    lines += _memory_lines(report["train_memory"])
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _auto(m: dict[str, Any]) -> str:
    """How train.activation_checkpointing=auto came to its value here (it is each device's to decide)."""
    if not m["checkpointing_auto"]:
        return ""
    return " (auto, for these devices)" if "device_gb" in m else " (auto: each device decides; --device-memory-gb)"


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
    lines.append("  (* train.backend=auto's for this job on such GPUs)")
    if "fewest_devices" in m:
        fewest = m["fewest_devices"]
        fits = ", ".join(f"{t} {n if n else 'none of ' + str(m['worlds'][-1])}" for t, n in fewest.items())
        lines.append(f"  fewest train devices that fit {m['device_gb']:g} GB: {fits}")
        if fewest[m["backend"]]:
            lines.append(f"  -> train.min_devices=auto takes {fewest[m['backend']]} on such devices ({m['backend']})")
    return lines
