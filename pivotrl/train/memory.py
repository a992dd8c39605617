"""What a train device holds, by trainer, as arithmetic: nothing is allocated here.

For a policy of P parameters trained on W devices at the optimizer step, computing in a dtype of c bytes
(``train.precision``: 2 for bf16, 4 for fp32), each device holds:

    fsdp        16 P / W       fp32 weights, gradients and AdamW moments, a 1/W shard of each
                + 2 layers gathered in the compute dtype (the one running and the one prefetched)
                + the embedding and the head gathered (the first and last modules)
                  (on one device in fp32 nothing is gathered; below fp32 the same pieces are cast)
    zero        c P + 4 P      the compute-dtype weights and the fp32 gradient sum, whole
                + 12 P / W     the fp32 master weights and AdamW moments, a 1/W range of them
    replicated  16 P           all of it, whole (+ c P for the compute copy below fp32)

and the activations of one micro batch of T tokens (``train.micro_batch_tokens``) of a model of L layers,
width h and MLP width I (values a layer keeps per token for its backward: about 8 h around its attention
and 4.5 I in its MLP, in the compute dtype):

    checkpointed      L T h c + (8 h + 4.5 I) T c      every layer's input, and one layer recomputed
    not checkpointed  L (8 h + 4.5 I) T c
    + the log-probs' chunk: 3 x min(T, 1024) x V x 4   fp32 logits of 1024 positions, their softmax, gradient

Measured on CPU for a 98M-parameter model (fp32, checkpointed, 512-token micro batches),
``benchmarks/train_memory.py`` prints these figures beside the peaks it measures. A GPU adds the CUDA
context and the caching allocator's slack: ``fewest_devices`` keeps a tenth of the device free for them.
"""

from __future__ import annotations

from collections.abc import Callable

from pivotrl.model.config import ModelConfig
from pivotrl.train.traits import NAMES, TrainerKind, traits

TRAINERS = NAMES
LOGITS_CHUNK = 1024  # positions whose fp32 logits the chunked log-probs hold at once
HEADROOM = 0.9  # share of a device's memory the trainer may plan to use


def _fsdp_state(config: ModelConfig, world: int, c: int) -> dict[str, float]:
    p, h, v = config.num_parameters(), config.hidden_size, config.vocab_size
    outer = v * h * (1 if config.tie_word_embeddings else 2)
    layer = (p - outer - h) / config.num_hidden_layers
    out = {"fp32 weights, gradients, AdamW moments (1/W)": 16 * p / world}
    if world > 1 or c < 4:  # (gathered whole, or on one device cast to the compute dtype)
        out["2 layers gathered"] = 2 * layer * c
        out["embedding and head gathered"] = outer * c
    return out


def _zero_state(config: ModelConfig, world: int, c: int) -> dict[str, float]:
    p = config.num_parameters()
    return {"compute weights": c * p, "fp32 gradient sum": 4 * p, "fp32 master weights, AdamW moments (1/W)":
            12 * p / world}  # fmt: skip


def _replicated_state(config: ModelConfig, world: int, c: int) -> dict[str, float]:
    p = config.num_parameters()
    out = {"fp32 weights, gradients, AdamW moments": 16 * p}
    if c < 4:
        out["compute weights"] = c * p
    return out


# each trainer's state on one of W devices, by piece (the table in this module's docstring)
STATE: dict[TrainerKind, Callable[[ModelConfig, int, int], dict[str, float]]] = {
    TrainerKind.FSDP: _fsdp_state,
    TrainerKind.ZERO: _zero_state,
    TrainerKind.REPLICATED: _replicated_state,
}


def state_bytes(config: ModelConfig, trainer: str, world: int, compute_bytes: int = 2) -> dict[str, float]:
    """The trainer's state on each of ``world`` train devices, by piece."""
    kind = traits(trainer).kind  # (an unknown name fails here, naming those there are)
    if world < 1:
        raise ValueError(f"world: got {world!r}, must be >= 1")
    return STATE[kind](config, world, compute_bytes)


def activation_bytes(config: ModelConfig, tokens: int, compute_bytes: int = 2, checkpointed: bool = False
                     ) -> dict[str, float]:  # fmt: skip
    """The activations of one micro batch of ``tokens`` tokens, by piece."""
    h, c = config.hidden_size, compute_bytes
    per_layer = (8 * h + 4.5 * config.intermediate_size) * tokens * c
    if config.num_experts:  # a token's MLP is its top-k experts'
        per_layer = (8 * h + 4.5 * config.moe_intermediate_size * config.num_experts_per_tok) * tokens * c
    layers = config.num_hidden_layers
    out = (
        {"layer inputs kept": layers * tokens * h * c, "one layer recomputed": per_layer}
        if checkpointed
        else {"every layer's activations": layers * per_layer}
    )
    out["log-probs chunk (fp32)"] = 3 * min(tokens, LOGITS_CHUNK) * config.vocab_size * 4
    return out


def per_device(config: ModelConfig, trainer: str, world: int, tokens: int, compute_bytes: int = 2,
               checkpointed: bool = False) -> float:  # fmt: skip
    """Bytes one train device holds at the peak of an optimizer step on ``world`` devices."""
    state = state_bytes(config, trainer, world, compute_bytes)
    return sum(state.values()) + sum(activation_bytes(config, tokens, compute_bytes, checkpointed).values())


def fewest_devices(config: ModelConfig, trainer: str, device_bytes: float, most: int, tokens: int,
                   compute_bytes: int = 2, checkpointed: bool = False) -> int | None:  # fmt: skip
    """The fewest train devices (at most ``most``) whose share fits ``HEADROOM`` of ``device_bytes``; None if
    none does."""
    for world in range(1, most + 1):
        if per_device(config, trainer, world, tokens, compute_bytes, checkpointed) <= HEADROOM * device_bytes:
            return world
    return None
