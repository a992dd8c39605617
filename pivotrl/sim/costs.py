"""Cost models: how many seconds each thing a device does takes, in closed form.

The simulator driver asks a ``CostModel`` and advances its virtual clock by the
answer. Two implementations:

- ``RooflineCosts``: from a GPU's datasheet and a model's shape. A step takes
  the longer of its FLOPs and its bytes, each at its peak rate times the share
  of it real kernels reach, plus the collectives of tensor parallelism and the
  host overhead a real engine pays every step.
- ``MeasuredCosts`` (``pivotrl.sim.measured``): from numbers the real runtime
  measured on its devices (a CPU run of the bundled tiny models, or a GPU run),
  so the simulator can be checked against the run it claims to predict.

No per-token loops: the simulator calls these millions of times, and
``decode_span`` prices a whole run of decode steps at once, so a driver
advances from event to event, not from token to token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Protocol, runtime_checkable

from pivotrl.control.messages import Role
from pivotrl.sim.hardware import GPU
from pivotrl.sim.models import ModelSpec

OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weights + Adam first and second moments, 4 bytes each
GRAD_BYTES_PER_PARAM = 4  # gradients reduced in fp32 (the usual mixed-precision reduce dtype)
# One Adam update touches, per parameter: reads of master, m, v and the fp32 gradient (16 bytes), writes of
# master, m and v (12) and of the bf16 working copy (2).
ADAM_BYTES_PER_PARAM = 30


@runtime_checkable
class CostModel(Protocol):
    """Seconds of each operation the simulator driver schedules on a device or instance."""

    def decode_step(self, model: ModelSpec, tp: int, batch: int, mean_context: float) -> float:
        """One decode step of ``batch`` sequences (``mean_context`` tokens of context each) on one
        instance of ``tp`` GPUs."""
        ...

    def decode_span(self, model: ModelSpec, tp: int, batch: int, context: float, steps: int) -> float:
        """``steps`` decode steps of a fixed batch whose mean context starts at ``context`` and grows by
        one token a step: the sum of ``decode_step`` over them, in closed form."""
        ...

    def prefill(self, model: ModelSpec, tp: int, tokens: int, seq_len: int | None = None) -> float:
        """One forward pass over ``tokens`` prompt tokens, in sequences of ``seq_len`` (default: one)."""
        ...

    def max_batch(self, model: ModelSpec, tp: int, context_len: int) -> int:
        """Most sequences of ``context_len`` tokens one instance holds at once (0: it cannot run)."""
        ...

    def kv_tokens(self, model: ModelSpec, tp: int) -> int | None:
        """Tokens of KV cache one instance holds, shared by its sequences as they grow (a paged
        engine); None where the engine has fixed slots and ``max_batch`` alone limits it."""
        ...

    def train_tokens(self, model: ModelSpec, tokens: int, n_gpus: int, seq_len: int = 0) -> float:
        """Forward and backward over ``tokens`` tokens split over ``n_gpus`` data-parallel devices."""
        ...

    def optimizer_step(self, model: ModelSpec, n_gpus: int) -> float:
        """Gradient synchronisation and the optimizer update of a ``n_gpus`` training group."""
        ...

    def shift(self, model: ModelSpec, src: Role | None, dst: Role, tp: int) -> float:
        """A device leaving ``src`` (None: it held no role) for ``dst``, the role's state split over ``tp``."""
        ...

    def regroup(self, model: ModelSpec, n_gpus: int) -> float:
        """A train group of ``n_gpus`` meeting anew (its process group made): paid by an optimizer step whose
        set of train devices is not the last step's. The runtime keeps a group as long as its set holds
        (``pivotrl.runtime.groups``), so a device joining the train role between steps pays none of it."""
        ...

    def migration(self, model: ModelSpec, tp: int, tokens: int) -> float:
        """Resuming a migrated sequence: re-prefill of its ``tokens`` (prompt plus output so far)."""
        ...

    def refresh(self, model: ModelSpec, tp: int) -> float:
        """A rollout instance taking the next policy version: new weights into its running engine."""
        ...

    def spread(self, kind: str) -> float:
        """How much one operation of ``kind`` (one of ``SPREAD_KINDS``) varies about the seconds above:
        the coefficient of variation of its duration, 0 where every one takes exactly that long."""
        ...


# Operations whose durations a cost model may say vary (``CostModel.spread``): a shift, one backward
# call, one optimizer step. Where devices wait for each other (every device's shift before the
# colocated step goes on, every rank's backward before the optimizer step), the wait is for the
# slowest of them, not the mean.
SPREAD_KINDS = ("shift", "accumulate", "optimizer")


_REALS = (int, float)


def _check(name: str, value: float, minimum: float = 0.0) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (minimum <= value < math.inf):
        raise ValueError(f"{name}: got {value!r}, must be a finite number >= {minimum:g}")


def check_spread_kind(kind: str) -> None:
    if kind not in SPREAD_KINDS:
        raise ValueError(f"spread: unknown kind {kind!r}; allowed: {', '.join(SPREAD_KINDS)}")


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: got {value!r}, must be an int >= 0")


def _check_tp(tp: int, name: str = "tp") -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"{name}: got {tp!r}, must be an int >= 1")


def kv_tokens(model: ModelSpec, tp: int, gpu: GPU, mem_fraction: float = 0.9) -> int:
    """Tokens whose KV cache fits in an instance of ``tp`` GPUs.

    The engine claims ``mem_fraction`` of HBM (vLLM's ``gpu_memory_utilization``; the rest is the
    activations, CUDA graphs, allocator slack, and the CUDA contexts of the GPU's other processes: each
    device runs its trainer and each vLLM engine in a process of its own: an estimated half a GB each,
    ``pivotrl.resolve.CUDA_CONTEXT_BYTES``, which ``make gpu-check`` measures);
    weights take theirs, the KV cache the rest. KV
    heads split over the GPUs, but never finer than one head: with ``tp > kv_heads`` each head is
    replicated on ``tp / kv_heads`` GPUs.
    """
    _check_tp(tp)
    if not 0 < mem_fraction <= 1:
        raise ValueError(f"mem_fraction: got {mem_fraction!r}, must be in (0, 1]")
    free = tp * gpu.hbm_bytes * mem_fraction - model.weight_bytes
    return max(0, math.floor(free / (model.kv_bytes_per_token * tp / min(tp, model.kv_heads))))


def max_batch(model: ModelSpec, tp: int, gpu: GPU, context_len: int, mem_fraction: float = 0.9) -> int:
    """Sequences of ``context_len`` tokens whose KV cache fits in an instance of ``tp`` GPUs: what an
    engine that reserves every sequence's longest context can run (``kv_tokens`` in slots)."""
    _check("context_len", context_len, 1)
    return kv_tokens(model, tp, gpu, mem_fraction) // context_len


def _series(line: tuple[float, float], start: int, count: int) -> float:
    """``sum(line[0] + line[1] * i for i in range(start, start + count))``."""
    return count * (line[0] + line[1] * (start + (count - 1) / 2)) if count > 0 else 0.0


def _sum_of_max(a: tuple[float, float], b: tuple[float, float], n: int) -> float:
    """``sum(max(a0 + a1*i, b0 + b1*i) for i in range(n))`` without the loop: the two lines cross
    at most once, so each side is an arithmetic series."""
    if a[1] == b[1]:
        return _series(max(a, b), 0, n)
    cross = (b[0] - a[0]) / (a[1] - b[1])
    below = min(n, max(0, math.ceil(cross)))  # steps i < cross
    first, then = (b, a) if a[1] > b[1] else (a, b)  # the steeper line wins past the crossing
    return _series(first, 0, below) + _series(then, below, n - below)


Span = Callable[[int, float, int], float]  # (batch, context, steps) -> seconds of that many decode steps


def span_of(costs: CostModel, model: ModelSpec, tp: int) -> Span:
    """``costs.decode_span`` of ``model`` on instances of ``tp`` GPUs, as a function of the batch,
    the context and the steps: what an engine calls in its inner loop, millions of times a run.
    A cost model may make it faster (``RooflineCosts.span_of``: no argument checks, its lines at hand)."""
    own = getattr(costs, "span_of", None)
    if own is not None:
        return own(model, tp)
    return lambda batch, context, steps: costs.decode_span(model, tp, batch, context, steps)


def steps_within(
    costs: CostModel, model: ModelSpec, tp: int, batch: int, context: float, seconds: float, limit: int
) -> int:
    """The most decode steps (at most ``limit``) that end within ``seconds``: how far a batch got when
    an event interrupts it (``span_steps_within`` over ``costs.decode_span``)."""
    return span_steps_within(span_of(costs, model, tp), batch, context, seconds, limit)


def span_steps_within(span: Span, batch: int, context: float, seconds: float, limit: int) -> int:
    """``steps_within`` over a ``span_of``. A guess from the step time and its growth with the context
    (exact while one roofline side binds), then a gallop and a bisection over the span: a few calls
    when the guess is right, O(log limit) at worst."""
    _check_count("limit", limit)

    def fits(steps: int) -> bool:
        return span(batch, context, steps) <= seconds

    first = span(batch, context, 1)
    growth = max(0.0, span(batch, context, 2) - 2 * first)
    if first <= 0 or seconds <= 0:
        guess = limit if first <= 0 else 0
    elif growth == 0:
        guess = min(limit, math.floor(seconds / first))
    else:  # first * n + growth * n (n - 1) / 2 = seconds
        b = first - growth / 2
        guess = min(limit, math.floor((-b + math.sqrt(b * b + 2 * growth * seconds)) / growth))
    lo, hi = 0, limit + 1  # fits(lo); not fits(hi) (hi = limit + 1: unknown)
    step = 1
    if fits(guess):
        lo = guess
        while lo + step <= limit:
            if not fits(lo + step):
                hi = lo + step
                break
            lo, step = lo + step, step * 2
    else:
        hi = guess
        while hi - step > 0:
            if fits(hi - step):
                lo = hi - step
                break
            hi, step = hi - step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True, slots=True)
class StepTime:
    """The terms of one forward pass; ``bound`` says which roofline side sets it."""

    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float

    @property
    def total(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"


@dataclass(frozen=True, slots=True)
class RooflineCosts:
    """Costs of a modeled GPU. Efficiencies are the share of a datasheet peak that real kernels reach."""

    gpu: GPU
    # decode matmuls have as many rows as sequences in the batch: a skinny GEMM reaches little of the
    # tensor-core peak; efficiency rises as max * b / (b + half), 0.3 of peak at 64 rows, 0.56 at 1024.
    compute_eff_max: float = 0.6
    compute_eff_half_batch: float = 64.0
    prefill_eff: float = 0.6  # assumed: prompts make large GEMMs (~70% of peak), less attention and launch gaps
    # weights stream contiguously: a public vLLM sweep of Llama-3.1-8B on an A100 decoded at batch 1 at 77% of
    # the HBM ceiling, overheads included
    bw_eff: float = 0.8
    kv_bw_eff: float = 0.7  # assumed: paged KV is read in 16-token blocks, less of HBM peak than the weights
    h2d_eff: float = 0.8  # pinned host-to-device copies reach ~50 of PCIe Gen5's 64 GB/s in bandwidth tests
    # the Llama 3 paper reports 38-43% bf16 MFU pretraining on H100s; RL micro-batches of ragged lengths get less
    mfu_dense: float = 0.35
    mfu_moe: float = 0.25  # assumed: MoE training loses to token all-to-all and small per-expert GEMMs
    # Overheads (assumed, sized so that a 7B model decodes alone in ~8 ms on an H100, as engines report):
    step_overhead_s: float = 2e-3  # host side of a step: scheduling, input preparation, sampling launch
    layer_overhead_s: float = 30e-6  # ~10 small kernels per layer (norms, rotary, activation) at ~3 us each
    seq_overhead_s: float = 20e-6  # host bookkeeping per sequence per step (inputs, outputs, stop checks)
    allreduce_latency_s: float = 10e-6  # one small all-reduce inside an NVLink node (NCCL or a custom kernel)
    # inference engine wake-up, its process kept (each model's engine lives in a process of its own, started with
    # the run, built at its device's first visit): KV cache re-allocation and a warm-up step (vLLM sleep mode
    # reports 0.1-0.4 s to wake small models), plus the control round trips to the engine's process
    engine_start_s: float = 1.0
    # a device taking the train role (train.backend=zero): its gradient sum allocated and zeroed (4 bytes a
    # parameter at HBM speed, ~10 ms for 7B), the backward hooks set, the control round trip
    train_build_s: float = 0.1
    # forward passes a trained token costs: its forward and a backward of two; 4 where activation checkpointing
    # runs each layer's forward again in the backward (train.activation_checkpointing, as the job resolves it)
    train_forwards: float = 3.0
    group_start_s: float = 2.0  # a new train group meets: its process group made (NCCL init), at the step
    mem_fraction: float = 0.9
    _NOT_NUMBERS = ("gpu", "_lines")  # (a class constant: not a field)
    # (id(model), tp, batch) -> (model, a decode step's line in the context): the simulator asks for a few
    # batches millions of times
    _lines: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in self._NOT_NUMBERS:
                _check(f.name, getattr(self, f.name))
        for name in ("compute_eff_max", "prefill_eff", "bw_eff", "kv_bw_eff", "h2d_eff", "mfu_dense", "mfu_moe"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name}: got {getattr(self, name)!r}, must be in (0, 1]")

    def compute_eff(self, batch: float) -> float:
        return self.compute_eff_max * batch / (batch + self.compute_eff_half_batch)

    def _allreduces(self, count: int, nbytes: float, group: int) -> float:
        """``count`` ring all-reduces of ``nbytes`` each over ``group`` GPUs: each GPU sends and receives
        ``2 (g-1)/g`` of the buffer."""
        if group == 1:
            return 0.0
        return count * (self.allreduce_latency_s + 2 * (group - 1) / group * nbytes / self.gpu.link_bw(group))

    def _overhead(self, model: ModelSpec, seqs: int) -> float:
        return self.step_overhead_s + self.layer_overhead_s * model.layers + self.seq_overhead_s * seqs

    def decode_terms(self, model: ModelSpec, tp: int, batch: int, mean_context: float) -> StepTime:
        """The terms of one decode step (``decode_step`` is their total)."""
        _check_tp(tp)
        _check("batch", batch)
        _check("mean_context", mean_context)
        if batch == 0:
            return StepTime(0.0, 0.0, 0.0, 0.0)
        g = self.gpu
        flops = batch * model.forward_flops(mean_context) / tp
        weights = model.params_read(batch) * model.dtype_bytes / tp
        kv = batch * mean_context * model.kv_bytes_per_token / min(tp, model.kv_heads)
        return StepTime(
            compute_s=flops / (g.peak_flops * self.compute_eff(batch)),
            memory_s=weights / (g.hbm_bw * self.bw_eff) + kv / (g.hbm_bw * self.kv_bw_eff),
            comm_s=self._allreduces(2 * model.layers, batch * model.hidden * model.dtype_bytes, tp),
            overhead_s=self._overhead(model, batch),
        )

    def decode_step(self, model: ModelSpec, tp: int, batch: int, mean_context: float) -> float:
        return self.decode_terms(model, tp, batch, mean_context).total

    def decode_span(self, model: ModelSpec, tp: int, batch: int, context: float, steps: int) -> float:
        # the checks' fast path first: the simulator's engines call this millions of times
        if type(steps) is not int or steps < 0:
            _check_count("steps", steps)
        if type(context) not in _REALS or not 0 <= context < math.inf:
            _check("context", context)
        if steps == 0 or batch == 0:
            return 0.0
        c0, c1, m0, m1, rest = self._decode_line(model, tp, batch)
        return _sum_of_max((c0 + c1 * context, c1), (m0 + m1 * context, m1), steps) + steps * rest

    def span_of(self, model: ModelSpec, tp: int) -> Span:
        """``decode_span`` of one model and instance size, without its argument checks (the engine
        passes its own counts) and with the lines of the batches seen kept at hand."""
        if type(self).decode_span is not RooflineCosts.decode_span:  # a subclass prices spans its own way
            return lambda batch, context, steps: self.decode_span(model, tp, batch, context, steps)
        _check_tp(tp)
        lines: dict[int, tuple[float, float, float, float, float]] = {}

        def span(batch: int, context: float, steps: int) -> float:
            if steps == 0 or batch == 0:
                return 0.0
            line = lines.get(batch)
            if line is None:
                line = lines[batch] = self._decode_line(model, tp, batch)
            c0, c1, m0, m1, rest = line
            # _sum_of_max inlined, its operations in its order (the same floats): its calls were a
            # third of this function's time
            a0, b0 = c0 + c1 * context, m0 + m1 * context
            if c1 == m1:
                y0, y1 = max((a0, c1), (b0, m1))
                return steps * (y0 + y1 * ((steps - 1) / 2)) + steps * rest
            below = min(steps, max(0, math.ceil((b0 - a0) / (c1 - m1))))
            if c1 > m1:  # memory binds first, compute past the crossing
                f0, f1, t0, t1 = b0, m1, a0, c1
            else:
                f0, f1, t0, t1 = a0, c1, b0, m1
            first = below * (f0 + f1 * ((below - 1) / 2)) if below > 0 else 0.0
            n = steps - below
            then = n * (t0 + t1 * (below + (n - 1) / 2)) if n > 0 else 0.0
            return first + then + steps * rest

        return span

    def _decode_line(self, model: ModelSpec, tp: int, batch: int) -> tuple[float, float, float, float, float]:
        """Compute and memory seconds of a decode step as ``a + b * context`` (both roofline sides are
        linear in the context: read off two adjacent steps), and the rest (collectives, overhead)."""
        # keyed by the model's identity (a dataclass hashes every field at each call), checked on a hit:
        # a model freed and another made at its address must not find the old one's line
        key = (id(model), tp, batch)
        hit = self._lines.get(key)
        if hit is not None and hit[0] is model:
            return hit[1]
        t0, t1 = self.decode_terms(model, tp, batch, 0.0), self.decode_terms(model, tp, batch, 1.0)
        line = (t0.compute_s, t1.compute_s - t0.compute_s, t0.memory_s, t1.memory_s - t0.memory_s,
                t0.comm_s + t0.overhead_s)  # fmt: skip
        self._lines[key] = (model, line)
        return line

    def prefill_terms(self, model: ModelSpec, tp: int, tokens: int, seq_len: int | None = None) -> StepTime:
        """The terms of one prefill pass; causal attention sees ``seq_len / 2`` tokens on average."""
        _check_tp(tp)
        _check("tokens", tokens)
        seq = tokens if seq_len is None else seq_len
        _check("seq_len", seq)
        if tokens == 0:
            return StepTime(0.0, 0.0, 0.0, 0.0)
        g = self.gpu
        flops = tokens * model.forward_flops(seq / 2) / tp
        weights = model.params_read(tokens) * model.dtype_bytes / tp
        return StepTime(
            compute_s=flops / (g.peak_flops * self.prefill_eff),
            memory_s=weights / (g.hbm_bw * self.bw_eff),
            comm_s=self._allreduces(2 * model.layers, tokens * model.hidden * model.dtype_bytes, tp),
            overhead_s=self._overhead(model, math.ceil(tokens / max(seq, 1))),
        )

    def prefill(self, model: ModelSpec, tp: int, tokens: int, seq_len: int | None = None) -> float:
        return self.prefill_terms(model, tp, tokens, seq_len).total

    def max_batch(self, model: ModelSpec, tp: int, context_len: int) -> int:
        return max_batch(model, tp, self.gpu, context_len, self.mem_fraction)

    def kv_tokens(self, model: ModelSpec, tp: int) -> int:
        return kv_tokens(model, tp, self.gpu, self.mem_fraction)

    def train_tokens(self, model: ModelSpec, tokens: int, n_gpus: int, seq_len: int = 0) -> float:
        """Forward + backward is 3 forward passes' FLOPs (6 per active weight per token; ``train_forwards``, 4 with
        activation checkpointing), plus causal attention over samples of ``seq_len`` tokens (0: left out), at the
        model family's MFU."""
        _check_tp(n_gpus, "n_gpus")
        _check("tokens", tokens)
        _check("seq_len", seq_len)
        flops = self.train_forwards * tokens * model.forward_flops(seq_len / 2)
        mfu = self.mfu_moe if model.is_moe else self.mfu_dense
        return flops / (n_gpus * self.gpu.peak_flops * mfu)

    def optimizer_step(self, model: ModelSpec, n_gpus: int) -> float:
        """ZeRO-1 over the whole group, as ``train.backend=zero`` runs it (``pivotrl.train.zero``): fp32 gradient
        sums reduce-scattered, each GPU updates its shard (memory-bound), the updated bf16 weights all-gathered.
        Each collective moves ``(g-1)/g`` of its buffer per GPU, over the network once the group leaves a
        node. Counted after the backward, not overlapped with it: an upper bound. A model-parallel
        trainer (TP/EP inside the node) would sync only its shard and pay far less for a 235B model.
        The shards live in the GPS between steps (the group changes from step to step): each GPU loads
        its ``1/n_gpus`` of the optimizer state over PCIe before the update and stores it back after."""
        _check_tp(n_gpus, "n_gpus")
        p = model.total_params
        update = p * ADAM_BYTES_PER_PARAM / n_gpus / (self.gpu.hbm_bw * self.bw_eff)
        shard = 2 * p * OPTIMIZER_BYTES_PER_PARAM / n_gpus / (self.gpu.h2d_bw * self.h2d_eff)
        if n_gpus == 1:
            return update + shard
        sync = (n_gpus - 1) / n_gpus * p * (GRAD_BYTES_PER_PARAM + model.dtype_bytes) / self.gpu.link_bw(n_gpus)
        return update + shard + sync + 2 * self.allreduce_latency_s

    def shift(self, model: ModelSpec, src: Role | None, dst: Role, tp: int) -> float:
        """Loading ``dst``'s state from host memory (the GPS) over PCIe, then starting its engine.

        Leaving a role copies nothing: the GPS already holds every weight version and, once the
        trainer has published, the optimizer state (``pivotrl.runtime.contexts``: release drops).
        Every role loads its weights, ``1/tp`` per GPU. The trainer's optimizer state is sharded over
        the whole train group (ZeRO-1, as ``optimizer_step`` prices it) and each GPU's shard is loaded
        at the optimizer step, not here: a shard depends on the group, known only once the step's
        backward is done. (A replicated trainer, each device holding the full AdamW state, would load
        12 bytes a parameter here, 91 GB for a 7B model: more than an 80 GB GPU holds beside it.)
        """
        _check_tp(tp)
        if src is dst:
            return 0.0
        load = model.weight_bytes / tp / (self.gpu.h2d_bw * self.h2d_eff)
        return load + (self.train_build_s if dst is Role.TRAIN else self.engine_start_s)

    def regroup(self, model: ModelSpec, n_gpus: int) -> float:
        _check_tp(n_gpus, "n_gpus")
        return self.group_start_s if n_gpus > 1 else 0.0

    def migration(self, model: ModelSpec, tp: int, tokens: int) -> float:
        return self.prefill(model, tp, tokens)

    def refresh(self, model: ModelSpec, tp: int) -> float:
        """The weights over PCIe, ``1/tp`` per GPU; the engine keeps running (no start-up)."""
        _check_tp(tp)
        return model.weight_bytes / tp / (self.gpu.h2d_bw * self.h2d_eff)

    def spread(self, kind: str) -> float:
        """0: the datasheet gives no spread, and every operation takes its modeled time."""
        check_spread_kind(kind)
        return 0.0


GIB = 2**30
TRAINER_BYTES_PER_PARAM = 18  # bf16 weights (2), fp32 gradients (4), fp32 master weights and Adam moments (12)


@dataclass(frozen=True, slots=True)
class DeployedCosts(RooflineCosts):
    """The roofline's compute, with the phase switches of the synchronous colocated frameworks users run
    today (verl, NeMo-RL, slime, OpenRLHF) in place of pivotrl's shifts. Each step, every GPU:

    - offloads the trainer's state to host memory and wakes the inference engine (vLLM sleep mode, level 1:
      its weights back from host memory), then receives the new policy weights from the trainer (the
      "weight sync", "refit" or "update_weights" of those frameworks);
    - once the whole rollout has ended, puts the rollout engine to sleep and wakes the colocated judge
      engine (its weights do not change, so no sync);
    - once every judgment is in, puts the judge to sleep and loads the trainer's state back.

    Each number below is a public measurement or a line through two of them, its source beside it (the
    trainer's bytes a parameter are the usual mixed-precision layout). Where a source measured a GPU
    other than the H100, the number is used as it is: these are host copies and framework code paths
    more than GPU speed.
    """

    _NOT_NUMBERS = ("gpu", "_lines", "policy_model", "judge_model")
    policy_model: ModelSpec | None = None  # the models whose engines sleep: set by the simulator
    judge_model: ModelSpec | None = None
    gpus: int = 0  # GPUs of the job, over which the trainer's state is sharded (0: one)
    # vLLM sleep mode (level 1) moves an engine's weights to and from host memory. Qwen3-235B-A22B-FP8 at
    # TP4 (~59 GB a GPU) woke in 5.3-5.7 s and slept in 5.8-6.0 s, about 10 GB/s a GPU each way (vLLM blog,
    # https://blog.vllm.ai/2025/10/26/sleep-mode.html, A100, vLLM 0.11; its data in vllm-project/
    # vllm-project.github.io assets/figures/2025-vllm-sleep-mode/plotly-sleep-mode.js). Qwen3-8B in a
    # colocated RL test woke in 2.19 s (~10 GB/s) and slept in 10.57 s (https://github.com/vllm-project/
    # vllm/pull/48337); Qwen3-30B-A3B at TP1 2.9 s and 2.8 s (~21 GB/s, the blog). 10 GB/s both ways.
    wake_bw: float = 10e9  # bytes/s a GPU, an engine's weights from host memory
    sleep_bw: float = 10e9  # bytes/s a GPU, an engine's weights to host memory
    # small models still take a moment: "~0.1-0.8s for small models" (level 1 wake, the vLLM blog above)
    engine_switch_s: float = 0.1
    # The trainer's state offloaded with torch_memory_saver's CPU backup (used by SGLang and slime), measured
    # at 2.41 GiB/s on pause and 5.32 GiB/s on resume (https://github.com/fzyzcjy/torch_memory_saver/
    # issues/111, L20); sharded over every GPU of the job (FSDP / ZeRO)
    trainer_offload_bw: float = 2.41 * GIB
    trainer_onload_bw: float = 5.32 * GIB
    # Weight sync of a dense model, a line through NeMo-RL v0.3's published refit times: Llama-3.1-8B 4-5 s
    # on 8 GPUs, Llama-3.1-70B 14-15 s on 64 (https://nvidia-nemo.github.io/blog/2025/07/21/nemo-rl-v0.3/,
    # quoted in https://github.com/NVIDIA-NeMo/RL/issues/959; a rerun there got 6-8 s and 20-26 s). It
    # gives ~7-8 s for ~30B, as NeMo-RL measured for a 30B dense model after a fix, 18 s -> 7 s
    # (https://github.com/NVIDIA-NeMo/RL/pull/449). verl's in-process FSDP -> vLLM sync of Qwen2.5-7B
    # takes 0.55 s on 8 L20s (https://github.com/verl-project/verl/pull/116): the best dense case.
    sync_dense_s: float = 4.5  # at 16 GB of bf16 weights (8B)
    sync_dense_s_per_gb: float = 10.0 / 125.0  # 70B: 141 GB, 10 s more
    # MoE: verl's Qwen3-MoE sync after its speed-up, 110 s -> 37 s (https://github.com/verl-project/verl/
    # pull/2692). Others: Qwen3-30B-A3B 55-63 s into SGLang on H100s (https://github.com/sgl-project/sglang/
    # issues/30848), NeMo-RL's 30B MoE 430 s -> 50 s (PR 449 above), slime's ~8 s after patches
    # (https://github.com/THUDM/slime/issues/132), NeMo-RL's NCCL refit 0.5-1.5 s in 2026
    # (https://github.com/NVIDIA-NeMo/RL/pull/2808, /pull/2971)
    sync_moe_s: float = 37.0

    def __post_init__(self) -> None:
        RooflineCosts.__post_init__(self)
        _check_count("gpus", self.gpus)
        for name in ("wake_bw", "sleep_bw", "trainer_offload_bw", "trainer_onload_bw"):
            _check(name, getattr(self, name), 1.0)

    def sync(self, model: ModelSpec) -> float:
        """The trainer's new weights into the rollout engine, once a step."""
        if model.is_moe:
            return self.sync_moe_s
        return self.sync_dense_s + max(0.0, model.weight_bytes / 1e9 - 16.0) * self.sync_dense_s_per_gb

    def trainer_swap(self, model: ModelSpec, offload: bool) -> float:
        """The trainer's state to (``offload``) or from host memory, sharded over every GPU of the job."""
        gpus = self.gpus or 1
        per_gpu = model.total_params * TRAINER_BYTES_PER_PARAM / gpus
        return per_gpu / (self.trainer_offload_bw if offload else self.trainer_onload_bw)

    def shift(self, model: ModelSpec, src: Role | None, dst: Role, tp: int) -> float:
        """Leaving ``src`` (its engine to sleep, or the trainer's state offloaded), then taking ``dst``
        (its engine woken, the policy's weights synced into the rollout engine, or the trainer's state
        loaded). ``model`` is ``dst``'s."""
        _check_tp(tp)
        if src is dst:
            return 0.0
        seconds = 0.0
        if src is Role.TRAIN:
            seconds += self.trainer_swap(self.policy_model or model, offload=True)
        elif src is not None:
            leaving = (self.policy_model if src is Role.ROLLOUT else self.judge_model) or model
            seconds += self.engine_switch_s + leaving.weight_bytes / tp / self.sleep_bw
        if dst is Role.TRAIN:
            return seconds + self.trainer_swap(model, offload=False)
        seconds += self.engine_switch_s + model.weight_bytes / tp / self.wake_bw
        return seconds + (self.sync(model) if dst is Role.ROLLOUT else 0.0)

    def refresh(self, model: ModelSpec, tp: int) -> float:
        """A rollout engine kept awake takes the next version by the same sync."""
        _check_tp(tp)
        return self.sync(model)


@dataclass(frozen=True, slots=True)
class ScaledCosts:
    """``base`` with its role changes and its migrations scaled (``sim.shift_scale``, ``sim.migration_scale``): a
    what-if, to see how much of a step they take. At 0 a device takes a new role, or a migrated sequence
    resumes, at once; at 0.5 they cost half. Everything else is ``base``'s. The planner learns the scaled
    shifts as it measures them (free ones it does not measure, and keeps its prior of a few hundredths of a
    second); it still prices a migration at its re-prefill, so a what-if with free migrations gains at least
    what it shows."""

    base: CostModel
    shift_scale: float = 1.0
    migration_scale: float = 1.0

    def __post_init__(self) -> None:
        _check("shift_scale", self.shift_scale)
        _check("migration_scale", self.migration_scale)

    def shift(self, model: ModelSpec, src: Role | None, dst: Role, tp: int) -> float:
        return self.shift_scale * self.base.shift(model, src, dst, tp)

    def migration(self, model: ModelSpec, tp: int, tokens: int) -> float:
        return self.migration_scale * self.base.migration(model, tp, tokens)

    def decode_step(self, model: ModelSpec, tp: int, batch: int, mean_context: float) -> float:
        return self.base.decode_step(model, tp, batch, mean_context)

    def decode_span(self, model: ModelSpec, tp: int, batch: int, context: float, steps: int) -> float:
        return self.base.decode_span(model, tp, batch, context, steps)

    def span_of(self, model: ModelSpec, tp: int) -> Span:
        return span_of(self.base, model, tp)

    def prefill(self, model: ModelSpec, tp: int, tokens: int, seq_len: int | None = None) -> float:
        return self.base.prefill(model, tp, tokens, seq_len)

    def max_batch(self, model: ModelSpec, tp: int, context_len: int) -> int:
        return self.base.max_batch(model, tp, context_len)

    def kv_tokens(self, model: ModelSpec, tp: int) -> int | None:
        return self.base.kv_tokens(model, tp)

    def train_tokens(self, model: ModelSpec, tokens: int, n_gpus: int, seq_len: int = 0) -> float:
        return self.base.train_tokens(model, tokens, n_gpus, seq_len)

    def optimizer_step(self, model: ModelSpec, n_gpus: int) -> float:
        return self.base.optimizer_step(model, n_gpus)

    def regroup(self, model: ModelSpec, n_gpus: int) -> float:
        return self.shift_scale * self.base.regroup(model, n_gpus)

    def refresh(self, model: ModelSpec, tp: int) -> float:
        return self.base.refresh(model, tp)

    def spread(self, kind: str) -> float:
        return self.base.spread(kind)
