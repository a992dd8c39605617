"""``pivotrl prepare``: build the bundled task data, starting policy and judge.

Nothing is downloaded. Both models are trained here, on the CPU, by SFT:

* the policy learns two-digit addition with a worked solution of
  long-tailed length, from targets that usually drop a units carry in the
  last step, so it starts well below what it can reach (see
  ``pivotrl.task.arithmetic``);
* the judge learns to read question, reference and response, write a
  rationale (the answer it read, the reference, a digit-by-digit comparison)
  and a verdict.

Each model directory gets a ``recipe.json`` with the recipe it was built
from; a directory whose recipe matches is reused, so ``prepare`` is cheap to
run again. Same seed, same machine: same weights.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pivotrl.config import JudgeConfig
from pivotrl.errors import UserError
from pivotrl.log import logger
from pivotrl.model import Decoder, ModelConfig, Tokenizer, char_tokenizer, save_model
from pivotrl.recipes.sft import sft
from pivotrl.task.arithmetic import (
    judge_target,
    judge_training_response,
    make_splits,
    policy_target,
    sft_pool,
    write_jsonl,
)
from pivotrl.task.data import read_jsonl

RECIPE_VERSION = 2


def recipe(seed: int) -> dict[str, Any]:
    """Everything that determines the bundled models; hashed into recipe.json."""
    arch = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
    return {
        "version": RECIPE_VERSION,
        "seed": seed,
        "policy": {
            "architecture": "Qwen2ForCausalLM",
            **arch,
            "steps": 1000,
            "batch": 128,
            "lr": 2e-3,
            "carry_drop": 0.65,
        },  # fmt: skip
        "judge": {
            "architecture": "LlamaForCausalLM",
            **arch,
            "steps": 600,
            "batch": 64,
            "lr": 2e-3,
            "template": JudgeConfig().template,
        },  # fmt: skip
    }


def _fingerprint(r: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest()[:16]


def _build(spec: dict[str, Any], tok: Tokenizer, seed: int) -> Decoder:
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim")  # fmt: skip
    cfg = ModelConfig(
        architecture=spec["architecture"],
        vocab_size=tok.vocab_size,
        **{k: spec[k] for k in keys},
        qkv_bias=spec["architecture"] == "Qwen2ForCausalLM",
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=list(tok.eos_token_ids),
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    model = Decoder(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return model


def ensure_data(data_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """The bundled task's train and held-out files under ``data_dir``, written there unless both are."""
    for path in (data_dir, *data_dir.parents):
        if path.exists() and not path.is_dir():
            where = "" if path == data_dir else f" ({path} is a file)"
            raise UserError(f"data directory {data_dir}: not a directory{where}; name a directory for the task data")
    train, heldout = data_dir / "train.jsonl", data_dir / "heldout.jsonl"
    if not (train.is_file() and heldout.is_file()):
        t, h = make_splits(seed)
        write_jsonl(t, train)
        write_jsonl(h, heldout)
    return train, heldout


def prepare(
    models_dir: str | Path = "models",
    data_dir: str | Path = "data/arithmetic",
    seed: int = 0,
    force: bool = False,
    progress: Callable[[str, int, int, float], None] | None = None,
) -> dict[str, Path]:
    """Build (or reuse) ``models_dir/policy`` and ``models_dir/judge``. Returns their paths."""
    models_dir = Path(models_dir)
    _, heldout_file = ensure_data(Path(data_dir))
    pool = sft_pool(read_jsonl(heldout_file))  # every length equally often, never a held-out problem
    r = recipe(seed)
    tok = char_tokenizer()
    eos = tok.eos_token_ids[0]
    judge_template = r["judge"]["template"]

    def policy_batch(rng: random.Random, n: int) -> list[tuple[list[int], list[int]]]:
        drop = r["policy"]["carry_drop"]
        return [
            (tok.encode(p.question), tok.encode(policy_target(p.question, rng, drop), add_special_tokens=False) + [eos])
            for p in rng.sample(pool, n)
        ]

    def judge_batch(rng: random.Random, n: int) -> list[tuple[list[int], list[int]]]:
        out = []
        for p in rng.sample(pool, n):
            resp = judge_training_response(p.question, p.reference, rng)
            prompt = judge_template.format(question=p.question, reference=p.reference, response=resp)
            out.append(
                (tok.encode(prompt), tok.encode(judge_target(resp, p.reference), add_special_tokens=False) + [eos])
            )
        return out

    built = {}
    for name, batch_fn in (("policy", policy_batch), ("judge", judge_batch)):
        spec = {"recipe": r, "model": name, "fingerprint": _fingerprint({"recipe": r, "model": name})}
        path = models_dir / name
        stamp = path / "recipe.json"
        if not force and stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == spec["fingerprint"]:
            logger.info("prepare: %s is up to date at %s", name, path)
            built[name] = path
            continue
        m = r[name]
        model = _build(m, tok, seed + (0 if name == "policy" else 1))
        logger.info(
            "prepare: training the %s (%d parameters, %d steps)", name, model.config.num_parameters(), m["steps"]
        )
        t0 = time.perf_counter()
        cb = None if progress is None else (lambda s, loss, name=name, m=m: progress(name, s + 1, m["steps"], loss))
        loss = sft(model, batch_fn, m["steps"], m["batch"], m["lr"], seed, cb)
        save_model(model, tok, path)
        stamp.write_text(json.dumps({**spec, "final_loss": loss, "seconds": time.perf_counter() - t0}, indent=2) + "\n")
        logger.info("prepare: %s done in %.0f s (loss %.4f) -> %s", name, time.perf_counter() - t0, loss, path)
        built[name] = path
    return built
