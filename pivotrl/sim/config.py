"""The ``sim`` section of the job config: what ``pivotrl simulate`` models.

The rest of the job config means what it means in a real run (``mode``,
``split``, ``steps``, ``seed``, ``rollout.*``, ``judge.max_new_tokens``,
``eval.*``); ``devices`` is replaced by ``gpus / tensor_parallel``: one device
of the control plane is one model instance of the job's ``tensor_parallel``
GPUs, which a simulated job holds as ``instance_gpus``
(``pivotrl.config.simulated_instances``). Checked when built, like every
section; whether ``lengths_file`` and a measured-costs file exist, and what
``auto`` and the models make of the instance size, is checked when the
simulation starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from pivotrl.sim.hardware import GPUS
from pivotrl.sim.models import MODELS
from pivotrl.sim.workload import LengthDist

LengthKindName = Literal["fixed", "uniform", "lognormal", "pareto"]
_PARAMS = {
    "fixed": ("value",),
    "uniform": ("lo", "hi"),
    "lognormal": ("median", "sigma"),
    "pareto": ("minimum", "alpha"),
}


def _int_at_least(obj: object, lo: int, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"{name}: expected an integer >= {lo}, got {value!r}")


@dataclass(slots=True)
class LengthsConfig:
    """Policy response lengths in tokens; only the parameters of ``kind`` are used. The cap is
    the job's ``rollout.max_new_tokens`` (``eval.max_new_tokens`` for evaluation)."""

    kind: LengthKindName = "lognormal"  # fixed | uniform | lognormal | pareto
    median: float = 1024.0  # lognormal: median length
    sigma: float = 0.8  # lognormal: spread of log(length)
    minimum: float = 256.0  # pareto: shortest length
    alpha: float = 1.5  # pareto: tail index (lower is heavier)
    value: int = 1024  # fixed: every length
    lo: int = 1  # uniform: shortest
    hi: int = 2048  # uniform: longest

    def __post_init__(self) -> None:
        try:
            self.dist(1 << 30)
        except ValueError as e:  # LengthDist names "<kind>.<param>"; the config names the param
            raise ValueError(str(e).removeprefix(f"{self.kind}.")) from None
        for name in ("median", "sigma", "minimum", "alpha"):  # (another kind's too: a kind= override uses them)
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name}: expected a finite number, got {value!r}")

    def dist(self, cap: int) -> LengthDist:
        """The distribution, capped at ``cap`` tokens."""
        params = {name: getattr(self, name) for name in _PARAMS[self.kind]}
        return LengthDist(self.kind, cap, **params)


KV_CACHES = ("paged", "reserved")


@dataclass(slots=True)
class SimConfig:
    gpu: str = "H100"  # modeled accelerator, a name in pivotrl.sim.hardware.GPUS
    gpus: int = 8  # GPUs in the cluster
    # GPUs per model instance: the job's tensor_parallel (this key's older name), an integer or auto; a
    # control-plane device is one instance
    instance_gpus: int | Literal["auto"] = 1
    # GPUs of each engine an instance runs a role on (0: one engine of all its GPUs): an instance of 4 GPUs
    # may roll out on 2 engines of 2 and judge on 1 of 4; its sequences are spread evenly over its engines
    rollout_engine_gpus: int = 0
    judge_engine_gpus: int = 0
    # a bound, not a mechanism: every decode span runs on the fastest layout of engines (of the sizes above
    # and their doublings up to the instance), changed for free; what elastic tensor parallelism could give
    elastic_engines: bool = False
    policy_model: str = "Qwen2.5-7B"  # policy shape, a name in pivotrl.sim.models.MODELS
    judge_model: str = "Qwen2.5-7B"  # judge shape, a name in MODELS
    lengths: LengthsConfig = field(default_factory=LengthsConfig)  # response length distribution
    lengths_file: str = ""  # JSONL trace of response lengths (an int or {"length": int} per line); overrides lengths
    # replay the trace: a response gets the length of the row with its step and uid ({"step", "uid",
    # "length"}, as samples.jsonl numbers them), drawn only where the trace has none
    lengths_replay: bool = False
    # correlation of a group's response lengths (one prompt's responses), on the normal scale of their
    # quantiles: 0 draws each alone, 1 gives the whole group one length; the distribution stays the same
    group_correlation: float = 0.0
    prompt_len: int = 512  # tokens of a policy prompt
    judge_template_len: int = 256  # tokens the judge prompt adds to the question and the response
    judge_output_len: int = 512  # tokens of a judgment (capped at judge.max_new_tokens; a capped one has no verdict)
    # spread of log(judgment length): > 0 makes judgments lognormal with median judge_output_len, as a
    # judge that reasons before its verdict writes them; 0 gives every judgment judge_output_len tokens
    judge_output_sigma: float = 0.0
    yes_probability: float = 0.5  # chance a response is right (and judged so); accuracy is not meaningful here
    slice_s: float = 5.0  # virtual seconds between two reports of a generating device
    react_s: float = 0.1  # the control plane's reaction time: completions this close are handled together
    # (at most half a slice)
    # "roofline" (from the GPU's datasheet), "deployed" (the roofline's compute with the phase switches of
    # today's colocated frameworks: ``DeployedCosts``, each number with its public source) or a MeasuredCosts
    # JSON file
    costs: str = "roofline"
    # "paged": sequences share an instance's KV cache as they grow (vLLM, SGLang); "reserved": each holds
    # a slot of its longest context. Measured costs always have the fixed slots of the engine they measured
    kv_cache: str = "paged"
    # what-ifs: role changes (shifts, phase switches) and sequence migrations at this share of their modeled
    # cost (0: free, 1: as modeled); how much of a step they take is the difference
    shift_scale: float = 1.0
    migration_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise ValueError(f"gpu: expected one of {', '.join(GPUS)}, got {self.gpu!r}")
        for name in ("policy_model", "judge_model"):
            if getattr(self, name) not in MODELS:
                raise ValueError(f"{name}: expected one of {', '.join(MODELS)}, got {getattr(self, name)!r}")
        _int_at_least(self, 1, "gpus", "prompt_len", "judge_output_len")
        if self.instance_gpus != "auto":
            _int_at_least(self, 1, "instance_gpus")
        _int_at_least(self, 0, "judge_template_len", "rollout_engine_gpus", "judge_engine_gpus")
        if not isinstance(self.elastic_engines, bool):
            raise ValueError(f"elastic_engines: expected true or false, got {self.elastic_engines!r}")
        if self.instance_gpus != "auto":  # (auto: checked once resolved, ``pivotrl.sim.run.build``)
            self.check_instances(self.instance_gpus)
        if not (isinstance(self.judge_output_sigma, float | int) and 0 <= self.judge_output_sigma < math.inf):
            raise ValueError(f"judge_output_sigma: expected a number >= 0, got {self.judge_output_sigma!r}")
        if not (isinstance(self.yes_probability, float | int) and 0 <= self.yes_probability <= 1):
            raise ValueError(f"yes_probability: expected a number in [0, 1], got {self.yes_probability!r}")
        if not isinstance(self.lengths_replay, bool):
            raise ValueError(f"lengths_replay: expected true or false, got {self.lengths_replay!r}")
        if self.lengths_replay and not self.lengths_file:
            raise ValueError("lengths_replay: needs a trace to replay (sim.lengths_file)")
        if not (isinstance(self.group_correlation, float | int) and 0 <= self.group_correlation <= 1):
            raise ValueError(f"group_correlation: expected a number in [0, 1], got {self.group_correlation!r}")
        if not (isinstance(self.slice_s, float | int) and 0 < self.slice_s < math.inf):
            raise ValueError(f"slice_s: expected a number > 0, got {self.slice_s!r}")
        if not (isinstance(self.react_s, float | int) and 0 <= self.react_s < math.inf):
            raise ValueError(f"react_s: expected a number >= 0, got {self.react_s!r}")
        for name in ("shift_scale", "migration_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, float | int) and 0 <= value < math.inf):
                raise ValueError(f"{name}: expected a number >= 0 (1: the modeled cost, 0: free), got {value!r}")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache: expected one of {', '.join(KV_CACHES)}, got {self.kv_cache!r}")
        if not isinstance(self.costs, str) or not self.costs:
            raise ValueError(
                f"costs: expected 'roofline', 'deployed' or a measured-costs JSON file, got {self.costs!r}"
            )

    def check_instances(self, tp: int) -> None:
        """Refuse (``ValueError``) what instances of ``tp`` GPUs cannot hold: a cluster they do not divide,
        engine sizes that do not divide them."""
        for name in ("rollout_engine_gpus", "judge_engine_gpus"):
            if tp % (getattr(self, name) or tp):
                raise ValueError(
                    f"{name}: expected 0 (one engine of the instance) or a divisor of tensor_parallel ({tp}), "
                    f"got {getattr(self, name)}"
                )
        if self.elastic_engines and tp == 1:
            raise ValueError("elastic_engines: an instance of 1 GPU has one layout; needs tensor_parallel >= 2")
        if self.gpus % tp:
            raise ValueError(
                f"gpus: expected a multiple of tensor_parallel ({tp}), got {self.gpus} "
                f"(a device is one instance of tensor_parallel GPUs)"
            )

    def judge_lengths(self, cap: int) -> LengthDist:
        """Tokens of a judgment, capped at ``cap`` (``judge.max_new_tokens``)."""
        if not self.judge_output_sigma:
            return LengthDist.fixed(self.judge_output_len, cap)
        return LengthDist.lognormal(self.judge_output_len, float(self.judge_output_sigma), cap)

    @property
    def devices(self) -> int:
        """Control-plane devices: model instances of ``instance_gpus`` GPUs (resolved: not auto)."""
        if self.instance_gpus == "auto":
            raise ValueError("instance_gpus: auto is resolved by pivotrl.sim.run.build")
        return self.gpus // self.instance_gpus
