"""The model groups of the cluster-scale comparison: a policy and its generative judge on 128 simulated H100s.

Each group is a job file under ``examples/paper/`` (``examples/sim128.yaml``'s workload with the group's
models, trainer and instance size, ``tensor_parallel``); ``benchmarks/paper.py`` runs every group in every mode
through
``pivotrl.sim.versus``, and the benchmarks beside it (the gap to the floor, the planner's estimates, engine
layouts, the replayed floor) run the same jobs. A group may carry further overrides (a point of a
sensitivity sweep: other lengths, another judge, another cluster size).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pivotrl.config import JobConfig, load_config
from pivotrl.errors import UserError
from pivotrl.resolve import Hardware, resolve
from pivotrl.runtime.devices import CUDA
from pivotrl.sim.hardware import GPUS
from pivotrl.sim.ideal import INSTANCE_SIZES, IdealStep, ideal_for_job, ideals_by_size
from pivotrl.sim.models import MODELS
from pivotrl.sim.run import build
from pivotrl.sim.workload import LengthDist
from pivotrl.train.traits import TrainerKind

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "examples" / "paper"
BASE = ROOT / "examples" / "sim128.yaml"  # the workload every group shares


@dataclass(frozen=True, slots=True)
class Group:
    """A model group: its job file and the overrides (``extra``) that make a variant of it."""

    name: str
    what: str
    config: Path
    extra: tuple[str, ...] = ()

    def job(self, overrides: list[str] | None = None) -> JobConfig:
        """The group's job with ``overrides`` (``job_overrides``' hold ``extra``), or with ``extra`` alone."""
        return load_config(self.config, list(self.extra) if overrides is None else overrides, simulated=True)

    @property
    def policy(self) -> str:
        return self.job().sim.policy_model

    @property
    def genrm(self) -> str:
        return self.job().sim.judge_model

    @property
    def instance_gpus(self) -> int:
        """The instance size the job file names (``tensor_parallel``): the one the shiftable mode runs fastest at
        on 128 GPUs."""
        return self.job().sim.instance_gpus


def _group(name: str, what: str) -> Group:
    return Group(name, what, JOBS / f"{name}.yaml")


GROUPS = {
    g.name: g
    for g in (
        _group("dense-7b", "dense pair"),
        _group("moe-30b", "MoE pair"),
        _group("judge-32b", "judge larger than the policy"),
        _group("dense-14b", "larger dense pair"),
        _group("reasoning-judge", "a larger judge that reasons"),
        _group("long-rollout", "rollouts to 16k tokens"),
    )
}


def job_overrides(group: Group, gpus: int, tp: int) -> list[str]:
    """The overrides of ``group.config`` that run the group on ``gpus`` GPUs in instances of ``tp``."""
    return [f"sim.gpus={gpus}", f"tensor_parallel={tp}", f"train.backend={trainer(group.policy, gpus)}",
            *group.extra]  # fmt: skip


@functools.cache
def trainer(policy: str, gpus: int) -> str:
    """Every mode's trainer for ``policy``: ZeRO-1 where its state fits on the modeled GPUs (6 bytes a parameter
    whole on each; it backpropagates each group as soon as it is judged), else FSDP2 (a 14B policy or larger on
    80 GB GPUs). The strongest that fits, for the baselines as for shiftable; ``train.backend=auto`` would give
    the static modes FSDP2."""
    cfg = load_config(BASE, [f"sim.policy_model={policy}", f"sim.gpus={gpus}", f"devices={gpus}", "train.backend=zero"])
    shape = MODELS[policy].train_config()
    fits = shape is not None and not resolve(cfg, Hardware(CUDA, GPUS[cfg.sim.gpu].hbm_bytes), shape).too_big
    return (TrainerKind.ZERO if fits else TrainerKind.FSDP).value


def ideal(config: str | Path, overrides: list[str]) -> IdealStep:
    """The ideal step of the job (its colocated form: a split names devices of one size)."""
    return ideal_for_job(load_config(config, [*overrides, "mode=colocated"], simulated=True))


def instance_sizes(group: Group, gpus: int, tps: tuple[int, ...] = INSTANCE_SIZES) -> dict[int, IdealStep]:
    """The ideal of each instance size of ``tps`` the runtime can build for both models (``ideals_by_size``: on
    one node, every model's heads, KV heads and MLP width cut evenly) and both fit on, with an instance for each
    role."""
    found = ideals_by_size(group.job(job_overrides(group, gpus, 1)), tps)
    out = {tp: step for tp, step in found.items() if gpus // tp >= 3}
    if not out:
        raise SystemExit(f"{group.name}: no instance size in {tps} fits both models on {gpus} GPUs")
    return out


def unbuilt_sizes(group: Group, gpus: int, tps: tuple[int, ...] = INSTANCE_SIZES) -> dict[str, str]:
    """Each size of ``tps`` that divides the cluster but is no layout of the group the runtime builds (an instance
    past a node, a model whose heads, KV heads or MLP width it cannot cut evenly, a model it cannot hold): the
    simulator's one-line refusal, by size."""
    out: dict[str, str] = {}
    for tp in tps:
        if gpus % tp == 0:
            try:
                build(group.job(job_overrides(group, gpus, tp)), warn=False)
            except UserError as e:
                out[str(tp)] = str(e)
    return out


def with_tp(overrides: list[str], tp: int) -> list[str]:
    """``overrides`` with instances of ``tp`` GPUs (where they name the size by either name)."""
    named = ("sim.instance_gpus=", "tensor_parallel=")
    return [x for x in overrides if not x.startswith(named)] + [f"tensor_parallel={tp}"]


# -- the sensitivity sweep's points ---------------------------------------------------------


def _fit(make: Callable[[float], LengthDist], mean: float, lo: float, hi: float) -> float:
    """The parameter in [lo, hi] at which ``make(x).mean()`` (increasing in x) equals ``mean``."""
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if make(mid).mean() < mean else (lo, mid)
    return (lo + hi) / 2


def tail_points(cap: int = 8192) -> list[tuple[str, list[str]]]:
    """Length distributions from uniform to a heavy tail, all at the mean length of sim128.yaml's lognormal."""
    mean = LengthDist.lognormal(1200, 0.9, cap).mean()
    out = [("uniform", ["sim.lengths.kind=uniform", "sim.lengths.lo=1", f"sim.lengths.hi={round(2 * mean - 1)}"])]
    for sigma in (0.5, 0.9, 1.3):
        median = 1200 if sigma == 0.9 else _fit(lambda m, s=sigma: LengthDist.lognormal(m, s, cap), mean, 1, cap)
        out.append((f"lognormal s={sigma}", [f"sim.lengths.median={median:.1f}", f"sim.lengths.sigma={sigma}"]))
    minimum = _fit(lambda m: LengthDist.pareto(m, 1.3, cap), mean, 1, cap)
    pareto = ["sim.lengths.kind=pareto", f"sim.lengths.minimum={minimum:.1f}", "sim.lengths.alpha=1.3"]
    out.append(("pareto a=1.3", pareto))
    return out


def reasoning_points() -> list[tuple[str, list[str]]]:
    """Judges that reason before their verdict: judgments lognormal about sim128.yaml's 512 tokens, and
    about as long as the responses, each cap raised so that about 1% run into it."""
    return [
        ("median 512 s=0.9", ["sim.judge_output_sigma=0.9", "judge.max_new_tokens=4096"]),
        ("median 1200 s=0.9", ["sim.judge_output_len=1200", "sim.judge_output_sigma=0.9", "judge.max_new_tokens=8192"]),
    ]


def short(model: str) -> str:
    """A model's name without its family: ``7B``, ``30B-A3B``."""
    return model.removeprefix("Qwen2.5-").removeprefix("Qwen3-")


def sweep_points(gpus: int, cluster: list[int], axes: tuple[str, ...]) -> list[tuple[str, str, Group, int]]:
    """The sweep's points about dense-7b on ``gpus`` GPUs: (axis, label, group, GPUs), the axes of ``axes``
    (``tail``, ``judge``, ``reasoning``, ``cluster``; ``cluster`` the sizes of ``cluster`` other than ``gpus``)."""
    base = GROUPS["dense-7b"]
    points: list[tuple[str, str, Group, int]] = []
    for label, extra in tail_points():
        slug = "tail-" + label.replace(" ", "-").replace("=", "")
        points.append(("length tail", label, Group(slug, base.what, base.config, tuple(extra)), gpus))
    for judge in ("Qwen2.5-1.5B", "Qwen2.5-14B", "Qwen2.5-32B"):
        group = Group(f"judge-{short(judge)}", "judge size", base.config, (f"sim.judge_model={judge}",))
        points.append(("judge size", short(judge), group, gpus))
    for label, extra in reasoning_points():
        slug = "reasoning-" + label.split(" ")[0]
        points.append(("judgment length", label, Group(slug, base.what, base.config, tuple(extra)), gpus))
    for size in cluster:
        if size != gpus:
            points.append(("cluster", f"{size} GPUs", Group(f"gpus-{size}", base.what, base.config), size))
    return [p for p in points if AXES[p[0]] in axes]


AXES = {"length tail": "tail", "judge size": "judge", "judgment length": "reasoning", "cluster": "cluster"}
