"""Decoder models of the Llama/Qwen families and their checkpoints.

The architecture (``ModelConfig``) reads without torch: the simulator and ``pivotrl plan`` size a
trainer's memory from it. The model, its checkpoints and tokenizer load torch when first named.
"""

from importlib import import_module
from typing import Any

from pivotrl.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError

_WHERE = {
    "Decoder": "decoder",
    "KVCache": "decoder",
    "CheckpointError": "loader",
    "load_model": "loader",
    "save_model": "loader",
    "Tokenizer": "tokenizer",
    "char_tokenizer": "tokenizer",
}

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "Tokenizer",
    "UnsupportedModelError",
    "char_tokenizer",
    "load_model",
    "save_model",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"pivotrl.model.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'pivotrl.model' has no attribute {name!r}")
