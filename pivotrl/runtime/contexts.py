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

POLICY, JUDGE = "policy", "judge"


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


class TrainContext:
    """Policy replica with gradients and optimizer state (restored from the GPS when published)."""

    def __init__(self, version: int, store: ParameterStore, spec: ContextSpec, make_trainer: Any) -> None:
        snap = store.fetch(POLICY, version)
        self.version, self.nbytes = version, snap.nbytes
        self.model, self.tokenizer = build_model(snap, torch.device(spec.device), DTYPES[spec.policy_dtype])
        for p in self.model.parameters():
            p.requires_grad_(True)
        self.trainer = make_trainer(self.model, version)
        if version in store.versions(POLICY, Kind.OPTIMIZER):  # none before the first update
            self.nbytes += self.trainer.import_state(store, POLICY, version, weights=False)

    def release(self) -> None:
        del self.trainer, self.model
