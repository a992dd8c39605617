"""The job config: one YAML file plus ``key=value`` overrides, checked when loaded.

The schema is the dataclasses below and nothing else: the loader reads each
field's type hint to convert and check the raw YAML, so there is no second
description of the config to keep in step. Range checks live in each
dataclass's ``__post_init__`` (so a config built in Python is checked too);
the loader adds the dotted path of the section, so every error names the
field as the user wrote it (``train.lr``), the bad value and what is allowed.

Overrides use dotted keys (``train.lr=1e-4 rollout.group_size=4``) and YAML
values. Relative paths (fields named ``path`` or ``*_file``) are made absolute
against the working directory at load time, so a config means the same thing
after a ``chdir``; whether the files exist is checked by the components that
open them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import string
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from pivotrl.control.spec import MAX_STALENESS
from pivotrl.sim.config import SimConfig
from pivotrl.task.checkers import CHECKERS
from pivotrl.train.config import TrainConfig

ROLES = ("rollout", "judge", "train")
Mode = Literal["colocated", "disaggregated", "shiftable"]
Dtype = Literal["float32", "bfloat16"]
Device = Literal["auto", "cuda", "cpu"]
# a generating model's dtype; auto: bfloat16 on a GPU (float16 on one without bfloat16), else the CPU's choice
ServingDtype = Literal["auto", "float32", "bfloat16", "float16"]
# generation backend: pivotrl's engine or vLLM; auto: vLLM on CUDA where it is installed (see docs/backends.md)
Backend = Literal["auto", "native", "vllm"]
Audit = Literal["auto", "on", "off"]  # the migration audit: auto (vLLM on a CPU), on or off
WandbMode = Literal["offline", "online"]


class ConfigError(ValueError):
    """A mistake in the job config; the message names the field, the value and what is allowed."""


def _check(obj: object, name: str, ok: Callable[[Any], bool], allowed: str) -> None:
    value = getattr(obj, name)
    if not ok(value):
        raise ValueError(f"{name}: expected {allowed}, got {value!r}")


def _at_least(obj: object, lo: int, *names: str) -> None:
    for name in names:
        _check(obj, name, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"an integer >= {lo}")


def _check_template(name: str, template: str, allowed: Sequence[str], required: str) -> None:
    """Reject a template whose fields would fail at ``format`` time, long before the first step."""
    try:
        fields_used = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"{name}: invalid format string ({e}; write {{{{ and }}}} for literal braces)") from None
    braces = ", ".join("{" + a + "}" for a in allowed)
    for f in sorted(fields_used):
        if f not in allowed:
            raise ValueError(f"{name}: unknown field {{{f}}} in {template!r} (allowed: {braces})")
    if required not in fields_used:
        raise ValueError(f"{name}: must contain {{{required}}}, got {template!r}")


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_split(spec: str) -> dict[str, int]:
    """Devices per role for disaggregated mode, from ``"rollout:2,judge:1,train:1"``; ``""`` gives ``{}``."""
    out: dict[str, int] = {}
    if not spec.strip():
        return out
    for item in spec.split(","):
        role, sep, count = (s.strip() for s in item.partition(":"))
        if not sep or not role or not count:
            raise ConfigError(f"split: {item.strip()!r} must look like role:count (e.g. 'rollout:2,judge:1,train:1')")
        if role not in ROLES:
            hint = " (the judge's role is named judge)" if role == "genrm" else ""
            raise ConfigError(f"split: unknown role {role!r} (allowed: {', '.join(ROLES)}){hint}")
        if role in out:
            raise ConfigError(f"split: role {role!r} given twice in {spec!r}")
        if not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise ConfigError(f"split: count of {role} must be an integer >= 1, got {count!r}")
        out[role] = int(count)
    return out


@dataclass(slots=True)
class ChatConfig:
    """A model's prompt in its chat template (the checkpoint's ``chat_template``): the formatted prompt
    becomes the user message, after an optional system message, with the assistant's turn opened."""

    enabled: bool = False  # render prompts in the checkpoint's chat template; off: the formatted prompt as it is
    system: str | None = None  # system message before each prompt; none: no system message (the template's default)

    def __post_init__(self) -> None:
        _check(self, "enabled", lambda v: isinstance(v, bool), "true or false")
        _check(self, "system", lambda v: v is None or isinstance(v, str), "a string or null")
        if self.system is not None and not self.enabled:
            raise ValueError(
                f"system: a system message needs the chat template (enabled is false), got {self.system!r}"
            )


@dataclass(slots=True)
class TaskConfig:
    # problems to sample prompts from: a .jsonl or .parquet file, or a folder written by datasets' save_to_disk
    train_file: str = "data/arithmetic/train.jsonl"
    heldout_file: str = "data/arithmetic/heldout.jsonl"  # problems for greedy evaluation (same formats)
    question_field: str = "question"  # the field (column) of the data that holds the question
    reference_field: str = "reference"  # the field (column) of the data that holds the reference answer
    checker: str = "exact"  # answer checker measuring accuracy: exact | math (see pivotrl/task/checkers.py)
    prompt_template: str = "{question}"  # policy prompt; only {question} is filled in
    chat_template: ChatConfig = field(default_factory=ChatConfig)  # the policy's prompt in its chat template

    def __post_init__(self) -> None:
        _check_template("prompt_template", self.prompt_template, ("question",), "question")
        for name in ("question_field", "reference_field"):
            _check(self, name, lambda v: isinstance(v, str) and v != "", "a non-empty field name")
        _check(self, "checker", lambda v: v in CHECKERS, f"one of {', '.join(CHECKERS)}")


@dataclass(slots=True)
class ModelRef:
    path: str = "models/policy"  # checkpoint directory (config.json, safetensors, tokenizer)
    dtype: Dtype = "float32"  # parameter dtype on device
    # dtype of the rollout copy; auto = bfloat16 on CUDA (float16 on a GPU without bfloat16), else `dtype`
    rollout_dtype: ServingDtype = "auto"


@dataclass(slots=True)
class JudgeConfig:
    path: str = "models/judge"  # generative judge checkpoint directory
    # dtype the judge is held in (GPS) and served in; auto = bfloat16 on CUDA (float16 on a GPU without bfloat16),
    # float32 on a CPU (whose bfloat16 matmuls are slow)
    dtype: ServingDtype = "auto"
    template: str = "Q:{question}\nR:{reference}\nA:{response}\nJ:"  # judge prompt
    verdict_pattern: str = "VERDICT: *(yes|no)"  # regex; its one group is the verdict label
    rewards: dict[str, float] = field(default_factory=lambda: {"yes": 1.0, "no": 0.0})  # label -> reward
    fallback_reward: float = 0.0  # reward when no verdict parses or the label is not in rewards
    max_new_tokens: int = 48  # judge generation budget per response
    temperature: float = 0.0  # judge sampling temperature; 0 = greedy
    backend: Backend = "auto"  # generation backend of the judge: auto | native | vllm
    chat_template: ChatConfig = field(default_factory=ChatConfig)  # the judge's prompt in its chat template

    def __post_init__(self) -> None:
        _check_template("template", self.template, ("question", "reference", "response"), "response")
        try:
            groups = re.compile(self.verdict_pattern).groups
        except re.error as e:
            raise ValueError(f"verdict_pattern: invalid regex {self.verdict_pattern!r} ({e})") from None
        if groups != 1:
            raise ValueError(
                f"verdict_pattern: expected a regex with exactly one capture group (the verdict label), "
                f"got {groups} in {self.verdict_pattern!r}"
            )
        _check(self, "rewards", bool, "a non-empty mapping of verdict label to reward")
        for label, reward in self.rewards.items():
            if not math.isfinite(reward):
                raise ValueError(f"rewards.{label}: expected a finite number, got {reward!r}")
        _check(self, "fallback_reward", math.isfinite, "a finite number")
        _at_least(self, 1, "max_new_tokens")
        _check(self, "temperature", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0 (0 = greedy)")


@dataclass(slots=True)
class RolloutConfig:
    prompts_per_step: int = 32  # prompts (GRPO groups) per training step
    group_size: int = 8  # responses sampled per prompt
    max_new_tokens: int = 96  # response length limit
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling mass; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    max_batch: int = 64  # engine slots (concurrent sequences) per device
    kv_cache_gb: float = 0.0  # KV-cache budget per device (10^9 bytes, rollout and judge engines); 0 = auto
    rebalance: bool = True  # once no sequence is queued, even out those in flight over the rollout devices
    backend: Backend = "auto"  # generation backend of the policy: auto | native | vllm
    # regenerate each migrated sequence from scratch beside it and count identical tokens (summary.json);
    # auto: with the vLLM backend on a CPU, whose kernels are not batch-invariant (the native engine's migration is
    # exact); off on CUDA, where it would be extra rollout compute on the hot path
    audit_migrations: Audit = "auto"

    def __post_init__(self) -> None:
        _at_least(self, 1, "prompts_per_step", "max_new_tokens", "max_batch")
        _at_least(self, 2, "group_size")  # a group of one has no baseline to compare against
        _at_least(self, 0, "top_k")
        _check(self, "temperature", lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
        _check(self, "top_p", lambda v: 0 < v <= 1, "a number in (0, 1]")
        _check(self, "kv_cache_gb", lambda v: math.isfinite(v) and v >= 0, "a number of GB >= 0 (0 = auto)")


@dataclass(slots=True)
class EvalConfig:
    every: int = 10  # evaluate every this many steps; 0 = only at start and end
    size: int = 500  # held-out problems evaluated, greedily
    max_new_tokens: int = 96  # response length limit during evaluation

    def __post_init__(self) -> None:
        _at_least(self, 0, "every")
        _at_least(self, 1, "size", "max_new_tokens")


@dataclass(slots=True)
class CheckpointConfig:
    every: int = 10  # write a checkpoint after every this many steps (none after the last); 0 = none
    keep: int = 2  # checkpoints kept, the newest; 0 = all

    def __post_init__(self) -> None:
        _at_least(self, 0, "every", "keep")


@dataclass(slots=True)
class LogConfig:
    """Where a run's numbers go besides its own files: TensorBoard event files and a Weights & Biases run, both
    kept in the run directory. Neither changes the job, so a resume may turn them on or off."""

    tensorboard: bool = False  # event files under RUN_DIR/tensorboard (needs the tensorboard package)
    wandb: bool = False  # a Weights & Biases run, its files under RUN_DIR/wandb (needs the wandb package)
    wandb_project: str = "pivotrl"  # the W&B project
    wandb_run_name: str = ""  # the W&B run's name; "" = the run directory's name
    wandb_mode: WandbMode = "offline"  # offline: nothing leaves the machine (`wandb sync` uploads it later); online

    def __post_init__(self) -> None:
        _check(self, "tensorboard", lambda v: isinstance(v, bool), "true or false")
        _check(self, "wandb", lambda v: isinstance(v, bool), "true or false")
        _check(
            self,
            "wandb_project",
            lambda v: isinstance(v, str) and v.strip() and "/" not in v,
            "a non-empty name without '/'",
        )
        _check(self, "wandb_run_name", lambda v: isinstance(v, str), 'a string ("" = the run directory\'s name)')
        _check(self, "wandb_mode", lambda v: v in get_args(WandbMode), "offline or online")


Phase = Literal["rollout", "judge", "backward", "optimizer", "shift"]
FaultKind = Literal["kill", "hang"]


@dataclass(slots=True)
class FaultConfig:
    """A fault injected on purpose (tests, drills): device ``device`` (or, with ``first``, whichever device
    it comes to first) dies (``kill``) or stops answering (``hang``) when it is sent the first command of
    ``phase`` in step ``step``. Ray devices only."""

    device: int = -1  # the device to fail; -1 = no fault (unless first)
    first: bool = False  # fail the first device sent a command of the phase in the step, whichever it is
    step: int = 1  # the step it fails in
    phase: Phase = "rollout"  # rollout | judge | backward | optimizer | shift
    # kill: the device's process dies; hang: it stops answering (device_timeout ends it); in the optimizer phase
    # it stops inside its part of the step, after meeting its group, as on a hung kernel
    kind: FaultKind = "kill"

    def __post_init__(self) -> None:
        _at_least(self, -1, "device")
        _at_least(self, 1, "step")


@dataclass(slots=True)
class JobConfig:
    seed: int = 0  # seeds data order, sampling and initialisation
    mode: Mode = "colocated"  # how roles share devices
    devices: int = 1  # devices the job runs on
    device: Device = "auto"  # what a device is; auto: cuda when there are GPUs (locally: torch sees CUDA; with
    # --ray-address: the cluster declares GPU resources), else cpu. On Ray, devices hold GPU shares wherever the
    # cluster declares GPUs; under auto one whose torch sees no CUDA computes on the CPU, under cuda it is an error
    gpus_per_device: float = 1.0  # share of one GPU each cuda device holds, in (0, 1]; 0.25 puts 4 devices on a GPU
    threads_per_device: int = 0  # torch threads per device; 0 = the node's cores shared among its devices (>= 1)
    # devices of one instance, on one node: the unit the roles shift in, one engine over all of its devices (vLLM
    # tensor parallel) and a trainer rank on each; devices must be a multiple of it. auto: the fewest that hold
    # every role (1 where the devices' memory is not known: CPUs); `pivotrl plan --device-memory-gb` shows the sums
    tensor_parallel: int | Literal["auto"] = 1
    split: str = ""  # disaggregated role layout, e.g. "rollout:2,judge:1,train:1"; "" = automatic
    steps: int = 60  # training steps
    # the most policy versions a sample may lag behind the version its step trains: step s's rollout begins once
    # version s - 1 - max_staleness is out, so up to max_staleness + 1 steps overlap (each judged and trained in
    # turn); 0: on-policy, a step's rollout waits for the previous update. See train.correction for the loss
    max_staleness: int = 0
    # with max_staleness >= 1: a sequence running on a rollout device an update left behind goes on with the newer
    # weights (moved to a device holding them, its tokens so far kept; each token's version is recorded), instead
    # of finishing on the older ones while that device takes no new work
    partial_rollout: bool = False
    task: TaskConfig = field(default_factory=TaskConfig)  # data and prompt format
    policy: ModelRef = field(default_factory=ModelRef)  # the model being trained
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # generative reward model
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # response sampling
    train: TrainConfig = field(default_factory=TrainConfig)  # GRPO update
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # checkpoints for --resume
    log: LogConfig = field(default_factory=LogConfig)  # metrics to TensorBoard and W&B as well
    # seconds any call to a device may take before the device is treated as lost (its work is redone elsewhere)
    device_timeout: float = 600.0
    restart_lost: bool = True  # start a lost device again (Ray devices): it rejoins holding no role
    fault: FaultConfig = field(default_factory=FaultConfig)  # a fault injected on purpose
    sim: SimConfig = field(default_factory=SimConfig)  # what `pivotrl simulate` models (ignored by train)

    def __post_init__(self) -> None:
        _at_least(self, 0, "seed")
        _at_least(self, 1, "devices", "steps")
        _check(
            self, "max_staleness", lambda v: type(v) is int and 0 <= v <= MAX_STALENESS,
            f"an integer from 0 (on-policy) to {MAX_STALENESS}",
        )  # fmt: skip
        _check(self, "partial_rollout", lambda v: isinstance(v, bool), "true or false")
        if self.partial_rollout and not self.max_staleness:
            raise ValueError(
                "partial_rollout: needs max_staleness >= 1 (on-policy, no newer version lands while a sequence runs)"
            )
        _at_least(self, 0, "threads_per_device")
        _check(self, "gpus_per_device", lambda v: 0 < v <= 1, "a number in (0, 1] (the share of one GPU per device)")
        _check(self, "device_timeout", lambda v: math.isfinite(v) and v > 0, "a finite number of seconds > 0")
        if self.fault.device >= self.devices and not self.fault.first:
            raise ValueError(
                f"fault.device: {self.fault.device} is not one of the {self.devices} devices (0..{self.devices - 1})"
            )
        if self.fault.step > self.steps:
            raise ValueError(f"fault.step: {self.fault.step} is after the last step ({self.steps})")
        split = parse_split(self.split)
        tp = self.tensor_parallel
        if tp != "auto":
            _at_least(self, 1, "tensor_parallel")
            if self.devices % tp:
                raise ValueError(
                    f"tensor_parallel: {tp} does not divide devices ({self.devices}): an instance is tensor_parallel "
                    f"devices; allowed: one of {', '.join(map(str, divisors(self.devices)))}, or auto"
                )
            for role, count in split.items():
                if count % tp:
                    raise ValueError(
                        f"split: {role}:{count} is not a whole number of instances of tensor_parallel={tp} devices "
                        f"(a role holds whole instances): use a multiple of {tp}"
                    )

    def instances(self, tensor_parallel: int) -> int:
        """The job's instances of ``tensor_parallel`` devices each: the control plane's devices."""
        return self.devices // tensor_parallel

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict; dumped as YAML it loads back to an equal config."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading


def load_config(
    path: str | Path | None, overrides: Sequence[str] = (), written: bool = False, simulated: bool = False
) -> JobConfig:
    """Defaults, then the YAML file at ``path`` (if any), then ``key=value`` overrides, later winning.
    ``written``: the file is a run's own config.json, which may use the names of an older version.
    ``simulated``: the job is for ``pivotrl simulate`` (``simulated_instances``)."""
    raw: dict[str, Any] = {} if path is None else _read_yaml(path)
    if written:
        raw = upgrade_written(raw)
    defaults = JobConfig().to_dict()
    for item in overrides:
        if simulated:
            _forget_other_instance_key(raw, item)
        _apply_override(raw, item, defaults)
    if simulated:
        raw = simulated_instances(raw)
    cfg = _build(JobConfig, raw, "")
    _resolve_paths(cfg)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> JobConfig:
    """A config from its ``to_dict()`` form (a run's config.json); keys added since it was written take their
    defaults, keys renamed since take their new names."""
    return _build(JobConfig, upgrade_written(raw), "")


INSTANCE_KEYS = ("tensor_parallel", "sim.instance_gpus")  # two names of a simulated job's instance size


def simulated_instances(raw: dict[str, Any]) -> dict[str, Any]:
    """A simulated job's raw config with its instance size (``tensor_parallel``) held as ``sim.instance_gpus``.

    The simulator's devices are the instances of ``sim.gpus`` (``devices`` is not read) and its ``split`` counts
    instances: in the job the control plane runs, a device is an instance, so ``tensor_parallel`` is 1 there
    and ``sim.instance_gpus`` says how many GPUs each one is. A config may name either key (``sim.instance_gpus``
    is the simulator's older name); naming both with different values is an error, where ``tensor_parallel: 1``
    (the default, and what a simulated run writes in its config.json) names nothing."""
    if "tensor_parallel" not in raw:
        return raw
    out = dict(raw)
    tp = _convert(_hints(JobConfig)["tensor_parallel"], out.pop("tensor_parallel"), "tensor_parallel")
    if tp != "auto" and tp < 1:
        raise ConfigError(f"tensor_parallel: expected an integer >= 1, got {tp}")
    sim = out.get("sim")
    if sim is not None and not isinstance(sim, Mapping):
        return out  # (its own error, naming sim)
    named = (sim or {}).get("instance_gpus")
    if named is not None and tp == 1:
        return out
    if named is not None and named != tp:
        raise ConfigError(
            f"tensor_parallel: {tp} and sim.instance_gpus: {named} both name the instance size "
            "(sim.instance_gpus is the simulator's older name for it): give tensor_parallel alone"
        )
    out["sim"] = {**(sim or {}), "instance_gpus": tp}
    return out


def _forget_other_instance_key(raw: dict[str, Any], item: str) -> None:
    """An override of either name of the instance size sets it, later winning as every override: the other
    name, where the file gives it, goes."""
    key = item.partition("=")[0].strip()
    if key not in INSTANCE_KEYS:
        return
    if key == "tensor_parallel" and isinstance(raw.get("sim"), dict):
        raw["sim"] = {k: v for k, v in raw["sim"].items() if k != "instance_gpus"}
    elif key != "tensor_parallel":
        raw.pop("tensor_parallel", None)


RENAMED_SIM_KEYS = {"genrm_model": "judge_model", "genrm_engine_gpus": "judge_engine_gpus"}


def upgrade_written(raw: dict[str, Any]) -> dict[str, Any]:
    """A config this project wrote (a run's config.json, a checkpoint's) in today's names: the judge's role was
    once ``genrm`` (``split``, ``sim.genrm_*``). Only for files a run wrote: a user's config with an old name
    fails naming the new one."""
    out = dict(raw)
    if isinstance(out.get("sim"), dict):
        out["sim"] = {RENAMED_SIM_KEYS.get(k, k): v for k, v in out["sim"].items()}
    if isinstance(out.get("split"), str):
        out["split"] = re.sub(r"\bgenrm(?=\s*:)", "judge", out["split"])
    return out


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(f"key {key!r} given twice")
        self.key, self.line, self.first = key, line, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping (two ``train:`` sections, ``lr``
    twice in one) is an error: PyYAML keeps the last, silently dropping what the user wrote first. Each mapping
    is checked once, as written, before its merge keys (``<<: *base``, whose keys those written beside it
    override) are flattened into it: PyYAML flattens a mapping in place, and an anchored one merged elsewhere
    first would then seem to hold its merged keys twice."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, line, seen[key])
                    seen[key] = line
                except TypeError:  # an unhashable key: the base class says so
                    continue
        super().flatten_mapping(node)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:  # (UTF-16 as some editors save it, or a binary file given by mistake)
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); "
            "save it as UTF-8"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # (a SafeLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"{path} line {e.line}: key {e.key!r} given twice (first at line {e.first})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        reason = getattr(e, "problem", None) or str(e).splitlines()[0]
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: invalid YAML: {reason}{where}") from None
    if not isinstance(data, dict | None):
        raise ConfigError(f"{path}: expected a mapping of config keys at top level, got {type(data).__name__}")
    return data or {}


def _apply_override(raw: dict[str, Any], item: str, defaults: dict[str, Any]) -> None:
    """Set one dotted key in the raw tree; a key inside a dict field (``judge.rewards.maybe=0.5``)
    edits the dict in effect, the default one when the file gives none."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"override {item!r} must look like key=value (e.g. train.lr=1e-4)")
    node, default = raw, defaults
    for i, part in enumerate(parts[:-1]):
        prefix, tp = ".".join(parts[: i + 1]), _lookup_type(parts[: i + 1])
        default = default.get(part) if isinstance(default, dict) else None
        if tp is not None and not (dataclasses.is_dataclass(tp) or get_origin(tp) is dict):
            raise ConfigError(f"override {item!r}: {prefix} is a value, not a section")
        child = node.get(part)
        if child is None:
            child = node[part] = dict(default or {}) if get_origin(tp) is dict else {}
        elif not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {prefix} is {child!r} in the config file, not a section")
        node = child
    node[parts[-1]] = _parse_value(_lookup_type(parts), text, item)


def _parse_value(tp: Any, text: str, item: str) -> Any:
    """Parse an override value as YAML, except where the field takes a string.

    There the text is taken as typed unless quoted, so ``task.prompt_template={question}``
    is not read as a YAML mapping, ``split=`` is not null and a newline stays a newline.
    """
    leaves = {None} if tp is None else _leaves(tp)
    if bool in leaves and str in leaves:  # (a field taking a boolean or words, auto: YAML's booleans are booleans)
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError:
            loaded = None
        if isinstance(loaded, bool):
            return loaded
    if int in leaves and str in leaves and text.strip().lstrip("+-").isdigit():  # (an integer or words, auto)
        return int(text)
    if (str in leaves or None in leaves) and text.strip()[:1] not in ("'", '"'):
        if not (type(None) in leaves and text.strip() in ("null", "~")):
            return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({getattr(e, 'problem', e)})") from None


def _leaves(tp: Any) -> set[Any]:
    """The scalar types a field accepts (a Literal of strings counts as str)."""
    if get_origin(tp) in (Union, types.UnionType):
        return set().union(*(_leaves(a) for a in get_args(tp)))
    if get_origin(tp) is Literal:
        return {type(a) for a in get_args(tp)}
    return {tp}


def _lookup_type(parts: Sequence[str]) -> Any:
    """Type hint of a dotted key in the schema, or None when the key is not in it."""
    tp: Any = JobConfig
    for part in parts:
        if dataclasses.is_dataclass(tp):
            tp = _hints(tp).get(part)
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        else:
            return None
        if tp is None:
            return None
    return tp


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return {k: v for k, v in get_type_hints(cls).items() if k in {f.name for f in dataclasses.fields(cls)}}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _build(cls: type, raw: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a dict, converting each field by its type hint."""
    if raw is None:
        raw = {}  # an empty YAML section ("train:" with nothing under it)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a section (mapping of keys), got {raw!r}")
    hints = _hints(cls)
    for key in raw:
        if key not in hints:
            allowed = ", ".join(hints)
            close = difflib.get_close_matches(str(key), list(hints), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown key {_join(path, str(key))!r} (allowed: {allowed}){hint}")
    kwargs = {name: _convert(hints[name], raw[name], _join(path, name)) for name in hints if name in raw}
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(_prefix(path, str(e), hints)) from e


def _prefix(path: str, msg: str, names: Mapping[str, Any]) -> str:
    """Name the section in an error from ``__post_init__``, which only knows its own field names."""
    if not path or msg.startswith(f"{path}."):
        return msg
    head = re.match(r"\w+", msg)
    return f"{path}.{msg}" if head and head.group() in names else f"{path}: {msg}"


_EXPECTED = {bool: "true or false", int: "an integer", str: "a string"}
_BOOL_HINT = " (YAML reads yes/no/true/false/on/off as booleans; quote it)"


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against type hint ``tp``, converting only where YAML falls short (ints, 1e-4)."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(get_args(tp)):
            return None
        if len(args) == 1:
            return _convert(args[0], value, path)
        for a in args:  # (bool | Literal["auto"]: the first that takes the value as it is)
            try:
                return _convert(a, value, path)
            except ConfigError:
                continue
        words = [w for a in args for w in _words(a)]
        raise ConfigError(f"{path}: must be {', '.join(words[:-1])} or {words[-1]}, got {value!r}")
    if origin is Literal:
        allowed = get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):  # YAML reads on/off as true/false
            return "on" if value else "off"
        if value not in allowed:
            hint = _BOOL_HINT if isinstance(value, bool) else ""
            raise ConfigError(f"{path}: must be one of {', '.join(map(str, allowed))}, got {value!r}{hint}")
        return value
    if origin is dict:
        key_type, value_type = get_args(tp)
        assert key_type is str, f"config type {tp} at {path}: only string keys are supported"
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        for k in value:
            if not isinstance(k, str):
                raise ConfigError(f"{path}: key {k!r} is not a string{_BOOL_HINT if isinstance(k, bool) else ''}")
        return {k: _convert(value_type, v, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        (item_type,) = get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_convert(item_type, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp in (bool, int, str):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            hint = _BOOL_HINT if tp is str and isinstance(value, bool) else ""
            raise ConfigError(f"{path}: expected {_EXPECTED[tp]}, got {value!r}{hint}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    raise TypeError(f"config field {path} has unsupported type {tp!r}")


def _words(tp: Any) -> list[str]:
    """How an error names what a field of type ``tp`` takes."""
    if tp is bool:
        return ["true", "false"]
    return [*map(str, get_args(tp))] or [_EXPECTED[tp]]


def _resolve_paths(obj: Any) -> None:
    """Make relative ``path`` / ``*_file`` fields absolute against the working directory."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _resolve_paths(value)
        elif isinstance(value, str) and value and (f.name == "path" or f.name.endswith("_file")):
            setattr(obj, f.name, os.path.abspath(os.path.expanduser(value)))
