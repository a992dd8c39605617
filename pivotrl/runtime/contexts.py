"""Role contexts: what a device holds while it plays a role.

| role    | context                                                        |
| ------- | -------------------------------------------------------------- |
| rollout | policy weights of version v, generation engine with its KV cache |
| judge   | judge weights (frozen), engine with its KV cache                |
| train   | policy weights of version v, gradients, optimizer state         |

A shift releases one context and loads the next, always from the Global
Parameter Storage (never from disk or another device). Loading checks the
version: a context serves only the version it was loaded with.

Device memory across shifts (generation contexts):

* staying in rollout (a new policy version): weights and KV cache are kept
  and the new version is copied into the same buffers (``refresh``);
* leaving rollout or judge: the KV cache, the engine and the weights' device
  storage are all freed, so the next role (or another device actor sharing the
  GPU) can take the memory; the worker then hands torch's cached blocks back to
  the device in one place (``Worker._release``). What is kept is a
  :class:`Skeleton`: the module tree on the meta device (no storage), the
  tokenizer and the dtype, a few kilobytes of host memory;
* coming back to that role: the skeleton is given fresh device storage and the
  version is loaded into it from the GPS, so a return costs the allocation
  plus the copy, not rebuilding the model and its tokenizer.

The KV cache is sized in tokens from a memory budget (``rollout.kv_cache_gb``,
see :mod:`pivotrl.engine.kv_budget`), once the weights are on the device.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer

from pivotrl.engine import Engine
from pivotrl.engine.kv_budget import GB, KVBudget, auto_budget, check_fits
from pivotrl.engine.protocol import GenerationEngine
from pivotrl.gps import Kind, ParameterStore, Snapshot, module_tensors
from pivotrl.log import logger
from pivotrl.model import Decoder, ModelConfig, Tokenizer
from pivotrl.model.chat import ChatTemplate
from pivotrl.model.loader import DTYPES
from pivotrl.train.config import TrainConfig
from pivotrl.train.models import decoder
from pivotrl.train.protocol import Trainer, TrainSetup
from pivotrl.train.registry import build as build_trainer

POLICY, JUDGE, REFERENCE = "policy", "judge", "reference"  # the reference: the frozen initial policy (KL)
CHECKPOINT_STATE = "policy.checkpoint"  # a sharded trainer's shards, copied for a checkpoint


def checkpoint_meta(model: Decoder, tokenizer: Tokenizer) -> dict[str, Any]:
    """Architecture and tokenizer travel with the weights, so a device anywhere can rebuild the model."""
    return {
        "config": model.config.to_hf(),
        "tokenizer": tokenizer.tok.to_str(),
        "eos": list(tokenizer.eos_token_ids),
        "pad": tokenizer.pad_token_id,
        "bos": tokenizer.bos_token_id,
    }


def publish_checkpoint(store: ParameterStore, name: str, version: int, model: Decoder, tokenizer: Tokenizer) -> int:
    """Publish a model's weights with what is needed to rebuild it; returns bytes stored."""
    return store.publish(name, version, module_tensors(model), Kind.WEIGHTS, checkpoint_meta(model, tokenizer)).nbytes


def tokenizer_of(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer a checkpoint's meta carries (:func:`checkpoint_meta`)."""
    return Tokenizer(HFTokenizer.from_str(meta["tokenizer"]), list(meta["eos"]), meta["pad"], meta["bos"])


def build_model(snap: Snapshot, device: torch.device, dtype: torch.dtype) -> tuple[Decoder, Tokenizer]:
    """A model and tokenizer rebuilt from a GPS snapshot (weights copied onto ``device``)."""
    return decoder(snap, device, dtype), tokenizer_of(snap.manifest.meta)


@dataclass(slots=True)
class ContextSpec:
    """How a device builds its contexts (plain values: it travels to Ray actors)."""

    device: str = "cpu"  # "cpu" or "cuda" (the device actor's own GPU)
    policy_dtype: str = "float32"  # the trainer's copy
    rollout_dtype: str = "float32"  # the rollout copy (policy.rollout_dtype, resolved: never "auto")
    judge_dtype: str = "float32"
    max_batch: int = 64
    max_len: int = 256  # policy sequences: prompt + response tokens
    judge_max_len: int = 512  # judge sequences: template + question + reference + response + judgment
    judge_template: str = "{response}"
    judge_chat: ChatTemplate | None = None  # the judge's chat template (judge.chat_template), around each prompt
    policy_chat: bool = False  # policy prompts come in its chat template (task.chat_template), rendered already
    kv_cache_bytes: int = 0  # KV-cache budget per device (rollout.kv_cache_gb); 0 = auto
    memory_share: float = 1.0  # share of the GPU this device may use when device actors share one (gpus_per_device)
    shared_gpu: bool = False  # other devices of the job are on its GPU: its train group goes through host memory
    rollout_backend: str = "native"  # generation backend of the policy (rollout.backend): native | vllm
    judge_backend: str = "native"  # generation backend of the judge (judge.backend)
    audit_migrations: bool = False  # generate each resumed sequence unmigrated beside it and compare (rollout.*)
    devices: int = 1  # the job's devices: the most an optimizer step can run on
    tensor_parallel: int = 1  # devices of an instance: ranks of each vLLM engine (Plan.tensor_parallel)

    def backend(self, name: str) -> str:
        return self.rollout_backend if name == POLICY else self.judge_backend

    def adds_special_tokens(self, name: str) -> bool:
        """Whether prompts of model ``name`` are encoded with the tokenizer's special tokens added (its
        BOS): not those in a chat template, which writes them itself (encoded as transformers does)."""
        return not (self.policy_chat if name == POLICY else self.judge_chat is not None)


@dataclass(slots=True)
class Skeleton:
    """What a released generation context leaves on its device: no device memory at all.

    ``model`` is the module tree on the meta device (parameters without
    storage, in the rollout dtype), ``tokenizer`` the parsed tokenizer.
    """

    name: str
    model: Decoder
    tokenizer: Tokenizer


def _materialize(model: Decoder, device: torch.device) -> Decoder:
    """Fresh (unset) storage on ``device`` for a skeleton's tensors; ties and the RoPE table restored."""
    model.to_empty(device=device)
    if model.config.tie_word_embeddings:  # to_empty gives each parameter its own storage: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = torch.tensor(model.config.inv_freq(), dtype=torch.float32, device=device)
    return model


def kv_budget(spec: ContextSpec, device: torch.device, weights_bytes: int) -> KVBudget:
    """The KV-cache budget of a generation context whose weights are already on ``device``.

    Explicit (``spec.kv_cache_bytes``): that many bytes, refused up front if the
    GPU cannot hold the cache it implies (checked by the engine's caller).
    Auto on CUDA: a fraction of what this device may still take
    (:func:`~pivotrl.engine.kv_budget.auto_budget`), counting the blocks
    torch's allocator caches in this process as free. Auto on a CPU: no budget.
    """
    explicit = spec.kv_cache_bytes > 0
    if device.type != "cuda":
        return KVBudget(spec.kv_cache_bytes if explicit else None, explicit, weights_bytes)
    if explicit:
        return KVBudget(spec.kv_cache_bytes, True, weights_bytes)
    _, total = torch.cuda.mem_get_info(device)
    free = device_free_bytes(device)
    assert free is not None
    held = torch.cuda.memory_allocated(device)
    return KVBudget(auto_budget(free, total, held, spec.memory_share), False, weights_bytes)


def device_free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on ``device`` can take (None on a CPU: not checked)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def release_device_memory(device: str) -> None:
    """Hand the blocks torch's CUDA allocator caches back to the device, so another process can use them.

    Within one process the allocator would reuse them anyway; but device actors
    sharing a GPU are separate processes, and the auto KV budget reads the
    memory the device reports free. Called once per shift, after a release.
    """
    if torch.device(device).type == "cuda":
        gc.collect()  # an FSDP2 model and its state hold each other: freed by the collector, not as released
        torch.cuda.empty_cache()


class GenerationContext:
    """Rollout (policy) or judge context: a generation engine holding version ``version`` of the model.

    The policy runs in ``spec.rollout_dtype``, the judge in ``spec.judge_dtype``,
    on the backend ``spec.backend(name)``. ``kept`` is what a released context
    of the same model left on this device: for the native engine a
    :class:`Skeleton` (the model is materialized from it instead of being
    built, see the module docstring); for vLLM the engine itself, asleep,
    woken here and given the version.
    """

    def __init__(
        self, name: str, version: int, store: ParameterStore, spec: ContextSpec, kept: Skeleton | Any = None
    ) -> None:
        dtype = DTYPES[spec.rollout_dtype if name == POLICY else spec.judge_dtype]
        device = torch.device(spec.device)
        snap = store.fetch(name, version)
        self.name, self.version, self.nbytes, self.backend = name, version, snap.nbytes, spec.backend(name)
        max_len = spec.max_len if name == POLICY else spec.judge_max_len
        self.meta = meta = snap.manifest.meta
        if self.backend == "vllm":
            from pivotrl.engine.vllm_engine import VllmEngine

            self.tokenizer = tokenizer_of(meta)
            if isinstance(kept, VllmEngine) and kept.dtype == dtype:
                kept.wake()  # (its length limit, fixed at the build, is what the first visit asked for)
                kept.load_weights(snap)
                self.engine: GenerationEngine = kept
            else:
                config = ModelConfig.from_hf(meta["config"])
                self.engine = VllmEngine(
                    config, dtype, device, spec.max_batch, max_len, spec.kv_cache_bytes, spec.memory_share, snap,
                    spec.tensor_parallel,
                )  # fmt: skip
            if spec.tensor_parallel > 1:  # (a rank copies its shard of the version: what it reports loading)
                self.nbytes = self.engine.held_bytes()
            return
        if isinstance(kept, Skeleton) and kept.name == name and next(kept.model.parameters()).dtype == dtype:
            self.model, self.tokenizer = _materialize(kept.model, device), kept.tokenizer
            snap.load_into(self.model)
        else:
            self.model, self.tokenizer = build_model(snap, device, dtype)
        weights = sum(t.numel() * t.element_size() for t in module_tensors(self.model).values())
        budget = kv_budget(spec, device, weights)
        free = device_free_bytes(device)
        if budget.explicit and free is not None:  # refuse before allocating, with the key's name, not an OOM
            check_fits(budget.plan(self.model.config, dtype, max_len, spec.max_batch), free, weights)
        engine = Engine(self.model, spec.max_batch, max_len, kv_budget=budget)
        if engine.max_batch < spec.max_batch:
            logger.info(
                "%s: KV cache of %d sequences x %d tokens (%.3g GB) holds fewer than rollout.max_batch=%d",
                name, engine.max_batch, max_len, engine.plan.nbytes / GB, spec.max_batch,
            )  # fmt: skip
        self.engine = engine

    def refresh(self, store: ParameterStore, version: int) -> int:
        """Load another version of the same model in place (the engine must be idle)."""
        snap = store.fetch(self.name, version)
        self.engine.load_weights(snap)
        self.version = version
        held = getattr(self.engine, "tensor_parallel", 1) > 1
        return self.engine.held_bytes() if held else snap.nbytes

    def release(self) -> Skeleton | Any:
        """Free what the context holds on the device; returns what is left to come back with.

        Native: the KV cache, the engine and the weights' device storage are
        freed, the skeleton returned. vLLM: the engine is put to sleep (on a GPU
        its weights and KV cache are freed) and returned.
        """
        if self.backend == "vllm":
            engine = self.engine
            engine.sleep()
            del self.engine
            return engine
        self.engine.cache = None  # type: ignore[attr-defined]  # drop the KV cache first, it is the largest part
        model, tokenizer = self.model, self.tokenizer
        del self.engine, self.model
        return Skeleton(self.name, model.to("meta"), tokenizer)


def compute_dtype(cfg: TrainConfig) -> torch.dtype:
    """The trainer's compute dtype, as the job's plan resolved ``train.precision``."""
    assert cfg.precision != "auto", "a train device is configured with the job's plan (pivotrl.resolve)"
    return torch.bfloat16 if cfg.precision == "bf16" else torch.float32


class TrainContext:
    """The train role on a device: the trainer ``train.backend`` names (:mod:`pivotrl.train.registry`), built
    from the version ``version`` in the GPS; the worker drives it through its protocol
    (:class:`~pivotrl.train.protocol.Trainer`) and its traits.

    Master weights are float32 whatever the checkpoint's dtype (``train.precision``
    only sets the compute dtype), so AdamW never updates bfloat16 weights.
    """

    def __init__(
        self,
        version: int,
        store: ParameterStore,
        spec: ContextSpec,
        cfg: TrainConfig,
        temperature: float,
        keep_versions: int = 2,
    ) -> None:
        device = torch.device(spec.device)
        snap = store.fetch(POLICY, version)
        # the trainer, its compute dtype and activation checkpointing: as the job's plan resolved them for every
        # device (pivotrl.resolve), never decided again here
        assert cfg.backend != "auto" and isinstance(cfg.activation_checkpointing, bool), "configured by the plan"
        setup = TrainSetup(
            store, version, snap, device, cfg, temperature, compute_dtype(cfg), DTYPES[spec.rollout_dtype],
            POLICY, REFERENCE, CHECKPOINT_STATE, keep_versions,
        )  # fmt: skip
        self.trainer: Trainer = build_trainer(cfg.backend, setup)
        self.nbytes = self.trainer.nbytes

    @property
    def version(self) -> int:
        """The policy version the trainer's weights hold."""
        return self.trainer.version

    def release(self) -> None:
        self.trainer.release()
