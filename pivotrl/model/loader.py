"""Load and save Hugging Face-format checkpoint directories.

Reads ``config.json``, ``model.safetensors`` or a sharded
``model.safetensors.index.json``, and ``tokenizer.json``. Pickled weights
(``*.bin``, ``*.pt``) are refused: only safetensors are data-only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pivotrl.model.config import ModelConfig
from pivotrl.model.decoder import Decoder
from pivotrl.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message says why."""


def read_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    return ModelConfig.from_hf(json.loads(file.read_text()))


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise CheckpointError(f"{path}: only pickled weights (*.bin/*.pt) found; pivotrl loads safetensors only")
    raise CheckpointError(f"{path}: no *.safetensors weights")


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                state[name] = f.get_tensor(name)
    return state


def load_model(
    path: str | Path, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[Decoder, Tokenizer]:
    """Load a local checkpoint directory: ``(model, tokenizer)``, model in eval mode."""
    path = Path(path)
    cfg = read_config(path)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise CheckpointError(f"unsupported dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    tokenizer = Tokenizer.load(path, eos_from_config=cfg.eos_token_id)
    model = Decoder.empty(cfg, device, dtype)
    state = load_state_dict(path)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match {cfg.architecture}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    return model.eval(), tokenizer


def save_model(model: Decoder, tokenizer: Tokenizer, path: str | Path) -> None:
    """Write a checkpoint directory that both pivotrl and transformers load."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(model.config.to_hf(dtype), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(path)
    gen = {"eos_token_id": tokenizer.eos_token_ids, "pad_token_id": tokenizer.pad_token_id}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
