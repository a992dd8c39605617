"""How many devices an instance needs: what one device of an instance holds for each generating role, as arithmetic.

A device plays one role at a time. Whatever it plays, it keeps a CUDA context for each of its processes (the
trainer's, and one per vLLM engine: ``pivotrl.resolve.CUDA_CONTEXT_BYTES`` each, asleep or not). On each device of an
instance of ``tp`` devices, an engine of a model holds:

    weights   the model's parameters in its serving dtype / tp
              (vLLM cuts the embedding, the head and every layer's matmuls in tp parts; the KV projections it
              copies where tp exceeds the KV heads, a few percent of a layer, left out)
    KV cache  rollout.max_batch sequences of the role's longest sequence, every one at its longest at once,
              / min(tp, KV heads) (with tp above the KV heads vLLM holds each head on several devices: a
              device's KV heads are max(1, heads // tp), ``ModelConfig.get_num_kv_heads`` in vLLM 0.32);
              ``rollout.kv_cache_gb`` instead where given (what each engine allocates, whatever the batch)
    contexts  the device's processes' CUDA contexts

and holds its batch where that is within ``ENGINE_FRACTION`` of the device's memory: the share pivotrl's vLLM
engines take (``gpu_memory_utilization``, ``pivotrl.engine.vllm_engine``; vLLM 0.32's ``request_memory`` in
``vllm/v1/worker/utils.py`` takes that share of the GPU, and ``determine_available_memory`` in ``gpu_worker.py``
gives the KV cache what the weights, the profiled activations and its own context leave of it). The device's other
processes' contexts lie outside that share and are counted inside it here: a margin for the activations, which
this arithmetic does not model. The native engine's auto budget (a share of what its weights leave) holds at least
as much.

A size that does not hold the whole batch still runs, slower: vLLM preempts sequences its cache cannot hold, the
native engine has fewer slots. So this sizes instances for the job's throughput, not only for starting. The trainer
does not enter: its ranks are every device of the step's train instances, so its state is shared over as many
devices whatever the instance size (``train.min_devices`` counts the instances it needs).

Pure arithmetic: ``pivotrl.resolve.tensor_parallel_for`` decides ``tensor_parallel=auto`` from it, ``pivotrl plan``
prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pivotrl.resolve import CUDA_CONTEXT_BYTES, DTYPE_BYTES, GB, VLLM, kv_bytes_per_token, uncut

if TYPE_CHECKING:
    from pivotrl.model.config import ModelConfig

NODE_GPUS = 8  # an instance is on one node; nodes of 8 GPUs (HGX/DGX) bound its size
ENGINE_FRACTION = 0.85  # of a device's memory an engine takes: vLLM's gpu_memory_utilization as pivotrl sets it
ROLE_MODEL = {"rollout": "policy", "judge": "judge"}
ENGINE_KEY = {"rollout": "rollout.backend", "judge": "judge.backend"}


@dataclass(frozen=True, slots=True)
class Engine:
    """What an engine of one model asks of its instance. ``max_len``: the role's longest sequence (prompt and
    generation); ``kv_cache_bytes``: a device's KV cache where ``rollout.kv_cache_gb`` fixes it (0: the batch's)."""

    role: str  # "rollout" or "judge"
    model: ModelConfig
    dtype: str
    batch: int
    max_len: int
    kv_cache_bytes: float = 0.0

    @property
    def weights(self) -> float:
        return self.model.num_parameters() * DTYPE_BYTES[self.dtype]

    @property
    def kv(self) -> float:
        """Bytes of keys and values of the whole batch at its longest, over all KV heads."""
        return self.batch * self.max_len * kv_bytes_per_token(self.model, self.dtype)

    def kv_cut(self, tp: int) -> int:
        """The parts the KV cache is cut in on ``tp`` devices: a KV head is never cut."""
        return min(tp, self.model.num_key_value_heads)

    def one_sequence(self, tp: int) -> float:
        """Bytes one device of an instance of ``tp`` holds for the weights and a single sequence at its longest:
        the least an engine starts with (vLLM refuses a cache that cannot hold one)."""
        return self.weights / tp + self.kv / self.batch / self.kv_cut(tp)

    def per_device(self, tp: int) -> tuple[float, float]:
        """(weights, KV cache) one device of an instance of ``tp`` holds."""
        return self.weights / tp, self.kv_cache_bytes or self.kv / self.kv_cut(tp)


@dataclass(frozen=True, slots=True)
class Sizing:
    """The engines' needs on devices of ``device_bytes``, beside ``processes`` CUDA contexts each. ``allowed``: the
    instance sizes ``tensor_parallel=auto`` chooses among."""

    device_bytes: float
    engines: tuple[Engine, ...]
    processes: int
    allowed: tuple[int, ...]
    why_allowed: str  # the rule ``allowed`` follows, for the reader

    @property
    def limit(self) -> float:
        """The bytes an engine may take of a device."""
        return ENGINE_FRACTION * self.device_bytes

    def need(self, engine: Engine, tp: int) -> float:
        """Bytes a device of an instance of ``tp`` holds for ``engine``, its CUDA contexts included."""
        return sum(engine.per_device(tp)) + self.processes * CUDA_CONTEXT_BYTES

    def holds(self, engine: Engine, tp: int) -> bool:
        return self.need(engine, tp) <= self.limit

    def sizes(self, engine: Engine, most: int = NODE_GPUS) -> list[int]:
        """The instance sizes up to ``most`` (a node's GPUs) that ``engine``'s model can be cut in."""
        return [tp for tp in range(1, most + 1) if not uncut(engine.model, tp)]

    def fewest(self, engine: Engine) -> int | None:
        """The fewest devices an instance of ``engine`` needs to hold its batch (None: more than a node's)."""
        return next((tp for tp in self.sizes(engine) if self.holds(engine, tp)), None)

    def starts(self, engine: Engine, tp: int) -> bool:
        """Whether ``engine`` starts on instances of ``tp``: its weights and one sequence."""
        return engine.one_sequence(tp) + self.processes * CUDA_CONTEXT_BYTES <= self.limit

    def holds_all(self) -> int | None:
        """The smallest allowed size that holds every engine's batch (None: none does)."""
        return next((tp for tp in self.allowed if all(self.holds(e, tp) for e in self.engines)), None)

    def auto(self) -> int | None:
        """The smallest allowed size that holds every engine's batch; where none does, the smallest where every
        engine starts (it runs fewer sequences at once than the batch: vLLM preempts the others); None where no
        size does."""
        held = self.holds_all()
        if held is not None:
            return held
        return next((tp for tp in self.allowed if all(self.starts(e, tp) for e in self.engines)), None)

    def refusal(self) -> str:
        """Why ``tensor_parallel=auto`` finds no size, in one line: the largest allowed size's shortfall for the
        least an engine starts with (its weights and one sequence)."""
        largest = self.allowed[-1]
        contexts = self.processes * CUDA_CONTEXT_BYTES
        short = [e for e in self.engines if not self.starts(e, largest)]
        what = "; ".join(
            f"the {ROLE_MODEL[e.role]}'s engine needs {(e.one_sequence(largest) + contexts) / GB:.1f} GB a device "
            f"(weights {e.weights / largest / GB:.1f} + one sequence's KV cache "
            f"{(e.one_sequence(largest) - e.weights / largest) / GB:.2f} + {self.processes} CUDA contexts "
            f"{contexts / GB:.1f})"
            for e in short
        )
        return (
            f"tensor_parallel=auto: no instance size holds even one sequence of every role on "
            f"{self.device_bytes / GB:g} GB devices: of the sizes allowed here ({', '.join(map(str, self.allowed))}: "
            f"{self.why_allowed}), on {largest} {what}, more than the {self.limit / GB:.1f} GB an engine takes "
            f"({ENGINE_FRACTION:g} of a device); use devices with more memory, more devices (an instance is a "
            f"divisor of devices), or a smaller model (pivotrl plan CONFIG tensor_parallel=N --device-memory-gb GB "
            "shows the arithmetic)"
        )

    def to_dict(self, tensor_parallel: int, auto: bool) -> dict[str, Any]:
        """Plain values in GB, for ``pivotrl plan`` (its --json) and :func:`describe`: each engine at each size it
        can be cut in up to a node's GPUs (or ``tensor_parallel``, if more)."""
        engines = []
        for e in self.engines:
            at = []
            for tp in self.sizes(e, max(NODE_GPUS, tensor_parallel)):
                weights, kv = e.per_device(tp)
                at.append({"devices": tp, "weights_gb": weights / GB, "kv_gb": kv / GB,
                           "need_gb": self.need(e, tp) / GB, "holds": self.holds(e, tp)})  # fmt: skip
            engines.append({
                "role": e.role, "parameters": e.model.num_parameters(), "dtype": e.dtype, "batch": e.batch,
                "max_len": e.max_len, "kv_heads": e.model.num_key_value_heads, "kv_fixed": bool(e.kv_cache_bytes),
                "fewest": self.fewest(e), "at": at,
            })  # fmt: skip
        return {
            "device_gb": self.device_bytes / GB,
            "limit_gb": self.limit / GB,
            "processes": self.processes,
            "allowed": list(self.allowed),
            "why_allowed": self.why_allowed,
            "auto": auto,
            "tensor_parallel": tensor_parallel,
            "holds_all": self.holds_all(),
            "engines": engines,
        }


def _terms(s: Sizing, e: Engine, tp: int) -> str:
    weights, kv = e.per_device(tp)
    contexts = s.processes * CUDA_CONTEXT_BYTES
    return f"weights {weights / GB:.1f} + KV cache {kv / GB:.1f} + {s.processes} CUDA contexts {contexts / GB:.1f}"


def sizing(
    cfg: Any,
    device_bytes: float,
    models: dict[str, ModelConfig | None],
    dtypes: dict[str, str],
    backends: dict[str, str],
    max_lens: dict[str, int],
) -> Sizing:
    """The engines of ``cfg`` (a ``JobConfig``) on devices of ``device_bytes``; each dict is keyed by role
    (``rollout``, ``judge``); a model that is None is not known and left out. Sizes allowed: the divisors of the
    job's devices up to a node's GPUs that every model can be cut in; 1 alone beside a native engine (it serves
    one device)."""
    r = cfg.rollout
    engines = tuple(
        Engine(role, m, dtypes[role], r.max_batch, max_lens[role], r.kv_cache_gb * GB)
        for role, m in models.items()
        if m is not None
    )
    processes = 1 + sum(b == VLLM for b in backends.values())
    native = [f"{ENGINE_KEY[role]}={b}" for role, b in backends.items() if b != VLLM]
    if native:
        why = f"{' and '.join(native)} serves one device; an instance of several needs vllm"
        return Sizing(device_bytes, engines, processes, (1,), why)
    allowed = [d for d in range(1, min(cfg.devices, NODE_GPUS) + 1) if cfg.devices % d == 0]
    allowed = [d for d in allowed if all(not uncut(e.model, d) for e in engines)]
    why = f"divisors of devices={cfg.devices} up to a node's {NODE_GPUS} GPUs that every model can be cut in"
    return Sizing(device_bytes, engines, processes, tuple(allowed), why)


def describe(d: dict[str, Any], prompt_bound: int) -> list[str]:
    """A sizing's ``to_dict`` in a few lines: each engine's fewest devices and the sums that make it, and what
    ``tensor_parallel`` is."""
    ctx = CUDA_CONTEXT_BYTES / GB
    lines = [
        f"instance sizes on {d['device_gb']:g} GB devices (a device holds one role at a time beside {d['processes']} "
        f"CUDA contexts of {ctx:g} GB, the trainer's and each vLLM engine's; an engine takes at most "
        f"{ENGINE_FRACTION:g} of a device, {d['limit_gb']:.1f} GB; KV caches for the whole batch at its longest, "
        f"prompts of at most {prompt_bound} tokens assumed):"
    ]
    for e in d["engines"]:
        name = "rollout, the policy" if e["role"] == "rollout" else "judge"
        kv = "rollout.kv_cache_gb" if e["kv_fixed"] else f"{e['batch']} x {e['max_len']} tokens"
        head = f"  {name} ({e['parameters'] / 1e9:.2f}B in {e['dtype']}, KV cache of {kv}, {e['kv_heads']} KV heads): "
        at = {row["devices"]: row for row in e["at"]}
        fewest = e["fewest"]
        if fewest is None:
            row = [r for r in e["at"] if r["devices"] <= NODE_GPUS][-1]
            lines.append(f"{head}more than a node's {NODE_GPUS} devices: on {row['devices']}: {_sums(row, d)}, "
                         f"over {d['limit_gb']:.1f}")  # fmt: skip
            continue
        text = f"{head}{fewest} device{'s' if fewest > 1 else ''}: {_sums(at[fewest], d)}"
        fewer = [tp for tp in at if tp < fewest]
        if fewer:
            text += f"; on {fewer[-1]}: {_sums(at[fewer[-1]], d)}, over {d['limit_gb']:.1f}"
        lines.append(text)
    if d.get("unsized"):
        lines.append(f"  judge: not sized, {d['unsized']}")
    lines.append(_train_line(d.get("train"), d))
    tp = d["tensor_parallel"]
    allowed = ", ".join(map(str, d["allowed"]))
    if d["auto"]:
        if d["holds_all"] is not None:
            lines.append(f"  -> tensor_parallel=auto takes {tp}: the smallest of {allowed} ({d['why_allowed']}) "
                         "that holds every role's batch")  # fmt: skip
        else:
            lines.append(
                f"  -> tensor_parallel=auto takes {tp}: none of {allowed} ({d['why_allowed']}) holds every role's "
                "batch; the smallest where each engine holds its weights and one sequence (fewer at once than the "
                "batch: vLLM preempts the others)"
            )
        return lines
    short = [ROLE_MODEL[e["role"]] for e in d["engines"] if not any(r["holds"] for r in e["at"] if r["devices"] == tp)]
    text = f"  -> tensor_parallel={tp}, as configured"
    if short:
        auto = d["holds_all"]
        text += (
            f": on instances of {tp} the {' and the '.join(short)}'s engine holds fewer sequences at once than the "
            f"batch (vLLM preempts the rest); " + (f"auto would take {auto}" if auto else "no size allowed holds it")
        )
    lines.append(text)
    return lines


def _train_line(t: dict[str, Any] | None, d: dict[str, Any]) -> str:
    """The trainer's share, which bounds no instance size: its ranks are every device of the step's instances."""
    bound = "no bound: its ranks are every device of the step's train instances, however many an instance has"
    if not t:
        return f"  train: {bound}"
    fewest = (
        f"{t['fewest']} devices at the fewest, {t['instances']} instance(s) of {d['tensor_parallel']} at the step "
        "(train.min_devices)"
        if t["fewest"]
        else "it fits no count of the job's devices (train.min_devices=auto refuses it)"
    )
    contexts = d["processes"] * CUDA_CONTEXT_BYTES / GB
    return (
        f"  train ({t['trainer']}): its state and a micro batch over the job's {t['devices']} devices "
        f"{t['share_gb']:.1f} + contexts {contexts:.1f} = {t['share_gb'] + contexts:.1f} GB a device "
        f"(pivotrl.train.memory); {fewest}; {bound}"
    )


def _sums(row: dict[str, Any], d: dict[str, Any]) -> str:
    """``weights 32.8 + KV cache 8.6 + contexts 1.5 = 42.9 GB`` of one size's row."""
    contexts = d["processes"] * CUDA_CONTEXT_BYTES / GB
    return (
        f"weights {row['weights_gb']:.1f} + KV cache {row['kv_gb']:.1f} + contexts {contexts:.1f} = "
        f"{row['need_gb']:.1f} GB"
    )
