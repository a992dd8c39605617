"""Load and save Hugging Face-format checkpoint directories.

Reads ``config.json``, ``model.safetensors`` or a sharded
``model.safetensors.index.json``, and ``tokenizer.json``. Pickled weights
(``*.bin``, ``*.pt``) are refused: only safetensors are data-only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pivotrl.errors import UserError
from pivotrl.model.config import ModelConfig, UnsupportedModelError
from pivotrl.model.decoder import Decoder
from pivotrl.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(UserError, ValueError):
    """A checkpoint directory that cannot be loaded; the message says why (the user's to fix: one line, exit 2)."""


def _read_json(file: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a mapping; what is wrong with it named with the file."""
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{file}: not UTF-8 text (a JSON file is expected)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e.msg}: line {e.lineno} column {e.colno})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def read_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        return ModelConfig.from_hf(_read_json(file))
    except KeyError as e:
        raise CheckpointError(f"{file}: no {e.args[0]!r}, which the model needs") from None
    except (CheckpointError, UnsupportedModelError):
        raise
    except (TypeError, ValueError) as e:  # (a number given as a string, a shape ModelConfig refuses)
        raise CheckpointError(f"{file}: {e}") from None


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
            raise CheckpointError(f"{index}: expected a 'weight_map' of tensor names to shard files")
        return [path / s for s in sorted(set(weight_map.values()))]
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
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    state[name] = f.get_tensor(name)
        except FileNotFoundError:  # (a shard the index names)
            raise CheckpointError(f"{file}: not found (a weight file of the checkpoint)") from None
        except SafetensorError as e:
            what = f"cannot be read as safetensors ({e}); the file is damaged or incomplete"
            raise CheckpointError(f"{file}: {what}") from None
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
    try:
        tokenizer = Tokenizer.load(path, eos_from_config=cfg.eos_token_id)
    except FileNotFoundError:
        raise
    except Exception as e:  # (the tokenizers library raises its own errors for a file it cannot parse)
        raise CheckpointError(f"{path / 'tokenizer.json'}: cannot be read as a tokenizer ({e})") from None
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
    shapes = model.state_dict()
    wrong = [f"{k} {tuple(state[k].shape)} (config.json: {tuple(shapes[k].shape)})"
             for k in sorted(expected) if tuple(state[k].shape) != tuple(shapes[k].shape)]  # fmt: skip
    if wrong:
        raise CheckpointError(
            f"{path}: {len(wrong)} weight(s) do not have the shape config.json gives them: {', '.join(wrong[:3])}"
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
