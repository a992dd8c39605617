"""Decoder models of the Llama/Qwen families and their checkpoints."""

from pivotrl.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from pivotrl.model.decoder import Decoder, KVCache
from pivotrl.model.loader import CheckpointError, load_model, save_model
from pivotrl.model.tokenizer import Tokenizer, char_tokenizer

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
