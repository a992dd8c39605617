"""Role contexts: what a device holds while it plays a role.

| role    | context                                                        |
| ------- | -------------------------------------------------------------- |
| rollout | policy weights of version v, generation engine with its KV cache |
| genrm   | judge weights (frozen), engine with its KV cache                |
| train   | policy weights of version v, gradients, optimizer state         |

A shift releases one context and loads the next, always from the Global
Parameter Storage (never from disk or another device). Loading checks the
version: a context serves only the version it was loaded with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer

from pivotrl.engine import Engine
from pivotrl.gps import Kind, ParameterStore, Snapshot, module_tensors
from pivotrl.model import Decoder, ModelConfig, Tokenizer
from pivotrl.model.loader import DTYPES
from pivotrl.sample import Sample
from pivotrl.train.config import TrainConfig

POLICY, JUDGE, REFERENCE = "policy", "judge", "reference"  # the reference: the frozen initial policy (KL)


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


def build_model(snap: Snapshot, device: torch.device, dtype: torch.dtype) -> tuple[Decoder, Tokenizer]:
    """A model and tokenizer rebuilt from a GPS snapshot (weights copied onto ``device``)."""
    meta = snap.manifest.meta
    model = Decoder.empty(ModelConfig.from_hf(meta["config"]), device, dtype)
    snap.load_into(model)
    tok = Tokenizer(HFTokenizer.from_str(meta["tokenizer"]), list(meta["eos"]), meta["pad"], meta["bos"])
    return model.eval(), tok


@dataclass(slots=True)
class ContextSpec:
    """How a device builds its contexts (plain values: it travels to Ray actors)."""

    device: str = "cpu"
    policy_dtype: str = "float32"
    judge_dtype: str = "float32"
    max_batch: int = 64
    max_len: int = 256  # policy sequences: prompt + response tokens
    judge_max_len: int = 512  # judge sequences: template + question + reference + response + judgment
    judge_template: str = "{response}"


class GenerationContext:
    """Rollout (policy) or judge context: weights plus an engine with its KV cache."""

    def __init__(self, name: str, version: int, store: ParameterStore, spec: ContextSpec) -> None:
        dtype = DTYPES[spec.policy_dtype if name == POLICY else spec.judge_dtype]
        snap = store.fetch(name, version)
        self.name, self.version, self.nbytes = name, version, snap.nbytes
        self.model, self.tokenizer = build_model(snap, torch.device(spec.device), dtype)
        self.engine = Engine(self.model, spec.max_batch, spec.max_len if name == POLICY else spec.judge_max_len)

    def refresh(self, store: ParameterStore, version: int) -> int:
        """Load another version of the same model in place (the engine must be idle)."""
        if self.engine.has_work:
            raise RuntimeError(f"{self.name}: cannot change weights while sequences are in flight")
        snap = store.fetch(self.name, version)
        snap.load_into(self.model)
        self.version = version
        return snap.nbytes

    def release(self) -> None:
        self.engine.cache = None  # type: ignore[assignment]  # drop the KV cache first, it is the largest part
        del self.engine, self.model


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    return torch.bfloat16 if cfg.resolved_precision(device.type) == "bf16" else torch.float32


class TrainContext:
    """The train role on a device, for either trainer backend (``train.backend``).

    Master weights are float32 whatever the checkpoint's dtype (``train.precision``
    only sets the compute dtype), so AdamW never updates bfloat16 weights.

    * replicated: a full replica with gradients and AdamW state, built here
      (weights, and the optimizer state once there is one, from the GPS);
      groups are backpropagated as they arrive.
    * fsdp: nothing heavy is built at the shift: the shards depend on the
      group, known at the step. Groups are buffered (``pending``) and the
      worker builds :class:`~pivotrl.runtime.sharded.ShardedTrainer` over the
      step's group (``sharded``), which then lives as long as this context.
    """

    def __init__(
        self, version: int, store: ParameterStore, spec: ContextSpec, cfg: TrainConfig, temperature: float
    ) -> None:
        from pivotrl.runtime.dist_train import ElasticTrainer
        from pivotrl.train.grpo import GRPOTrainer

        device = torch.device(spec.device)
        self.version, self.cfg, self.temperature = version, cfg, temperature
        self.backend = cfg.resolved_backend(device.type)
        self.compute = compute_dtype(cfg, device)
        snap = store.fetch(POLICY, version)
        self.meta = snap.manifest.meta  # architecture and tokenizer, published again with each new version
        self.nbytes = 0
        self.pending: list[tuple[list[Sample], list[float]]] = []
        self.sharded: Any = None  # ShardedTrainer, once the worker built it for a group
        self.trainer: Any = None  # ElasticTrainer (replicated)
        if self.backend == "fsdp":
            return
        self.model, self.tokenizer = build_model(snap, device, torch.float32)
        self.model.checkpoint_layers = cfg.activation_checkpointing
        self.nbytes = snap.nbytes
        for p in self.model.parameters():
            p.requires_grad_(True)
        ref = None
        if cfg.kl_coef > 0:
            ref_snap = store.fetch(REFERENCE, 0)
            ref, _ = build_model(ref_snap, device, torch.float32)
            ref.requires_grad_(False)
            self.nbytes += ref_snap.nbytes
        self.trainer = ElasticTrainer(GRPOTrainer(self.model, cfg, temperature, ref, self.compute), version=version)
        if version in store.versions(POLICY, Kind.OPTIMIZER):  # none before the first update
            self.nbytes += self.trainer.import_state(store, POLICY, version, weights=False)

    def release(self) -> None:
        self.trainer = self.sharded = self.pending = None
        if self.backend != "fsdp":
            del self.model
