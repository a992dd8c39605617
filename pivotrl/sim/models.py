"""Model shapes the simulator models: what sets a model's FLOPs, bytes read and KV cache.

Shapes come from each model's public ``config.json`` (``num_hidden_layers``,
``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``
where present, else ``hidden_size / num_attention_heads``, ``vocab_size``,
``tie_word_embeddings``, ``num_experts``, ``num_experts_per_tok``); parameter
counts from the model cards ("Number of Parameters").
"""

from __future__ import annotations

from dataclasses import dataclass

from pivotrl.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer, dense or mixture-of-experts (``experts`` > 0)."""

    name: str
    total_params: float  # every weight, embeddings included
    active_params: float  # weights one token goes through (== total_params for a dense model)
    layers: int
    hidden: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool  # the input embedding is the output head (counted once in total_params)
    experts: int = 0  # routed experts per MoE layer; 0: dense
    active_experts: int = 0  # experts each token is routed to
    dtype_bytes: int = 2  # bf16
    intermediate: int = 0  # MLP width (an expert's, in a MoE model): what a layer keeps for its backward (0: unknown)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {name} got {value!r}, must be an int >= 1")
        if not 0 < self.active_params <= self.total_params:
            raise ValueError(
                f"model {self.name!r}: active_params={self.active_params!r}, total_params={self.total_params!r}: "
                "need 0 < active_params <= total_params"
            )
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        dense = self.experts == 0 and self.active_experts == 0
        moe = 0 < self.active_experts < self.experts
        if not (dense or moe):
            raise ValueError(
                f"model {self.name!r}: experts={self.experts}, active_experts={self.active_experts}: "
                "need both 0 (dense) or 0 < active_experts < experts (MoE)"
            )
        if dense and self.active_params != self.total_params:
            raise ValueError(f"model {self.name!r}: a dense model has active_params == total_params")

    @classmethod
    def from_config(cls, config: ModelConfig, name: str, dtype_bytes: int = 2) -> ModelSpec:
        """The shape of a checkpoint's architecture (``ModelConfig.from_hf`` of its config.json), held in
        ``dtype_bytes`` a parameter: the parameters counted from the shape (``ModelConfig.num_parameters``), a
        token's active ones without the experts it is not routed to."""
        total = config.num_parameters()
        active = total
        if config.num_experts:  # each sparse layer's unrouted experts: E - k of them, 3 h I weights each
            sparse = sum(config.is_sparse_layer(i) for i in range(config.num_hidden_layers))
            unrouted = config.num_experts - config.num_experts_per_tok
            active -= sparse * unrouted * 3 * config.hidden_size * config.moe_intermediate_size
        return cls(
            name, float(total), float(active), config.num_hidden_layers, config.hidden_size,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size,
            config.tie_word_embeddings, config.num_experts, config.num_experts_per_tok, dtype_bytes,
            config.moe_intermediate_size if config.num_experts else config.intermediate_size,
        )  # fmt: skip

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def train_config(self) -> ModelConfig | None:
        """The shape ``pivotrl.train.memory`` reads, to size a trainer's memory (None: the MLP width is unknown)."""
        if not self.intermediate:
            return None
        shape = {"vocab_size": self.vocab, "hidden_size": self.hidden, "intermediate_size": self.intermediate,
                 "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                 "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                 "tie_word_embeddings": self.tied_embeddings}  # fmt: skip
        if not self.is_moe:
            return ModelConfig("Qwen2ForCausalLM", **shape)
        moe = {"num_experts": self.experts, "num_experts_per_tok": self.active_experts,
               "moe_intermediate_size": self.intermediate}  # fmt: skip
        return ModelConfig("Qwen3MoeForCausalLM", **shape, **moe)

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, unsharded."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def lookup_params(self) -> float:
        """Weights a token touches without a matmul: the input embedding table, unless the output head
        shares it (then the head's matmul reads it anyway)."""
        return 0.0 if self.tied_embeddings else float(self.vocab * self.hidden)

    @property
    def expert_params(self) -> float:
        """Weights of all routed experts, derived from the card's totals: a token uses ``k/E`` of them,
        so ``total - active = expert_params * (1 - k/E)``."""
        if not self.is_moe:
            return 0.0
        return (self.total_params - self.active_params) / (1 - self.active_experts / self.experts)

    @property
    def flops_per_token(self) -> float:
        """Matmul FLOPs of one token's forward pass, attention scores aside: 2 per active weight."""
        return 2 * (self.active_params - self.lookup_params)

    def attention_flops(self, context: float) -> float:
        """FLOPs of one token attending to ``context`` earlier tokens: QK^T and AV, 2 FLOPs per
        multiply-add each, in every layer and query head."""
        return 4 * self.layers * self.heads * self.head_dim * context

    def forward_flops(self, context: float) -> float:
        """All FLOPs of one token's forward pass at ``context`` tokens of context."""
        return self.flops_per_token + self.attention_flops(context)

    def params_read(self, tokens: float) -> float:
        """Weights a forward pass over ``tokens`` tokens reads from memory.

        Dense: all but the embedding lookup. MoE: the shared part plus the experts the tokens
        touch; with each of ``tokens * k`` routings drawn uniformly over ``E`` experts, an expert is
        touched with probability ``1 - (1 - k/E)^tokens``. Real routers are skewed, which touches
        fewer distinct experts: this is an upper bound on the bytes.
        """
        dense = self.total_params - self.lookup_params - self.expert_params
        if not self.is_moe:
            return dense
        touched = 1 - (1 - self.active_experts / self.experts) ** max(tokens, 1.0)
        return dense + self.expert_params * touched


def _qwen25(
    name: str, params: float, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, tied: bool,
    intermediate: int,
) -> ModelSpec:  # fmt: skip
    # Qwen2.5 config.json has no head_dim: it is hidden_size / num_attention_heads (128 for every size here)
    return ModelSpec(name, params, params, layers, hidden, heads, kv_heads, hidden // heads, vocab, tied,
                     intermediate=intermediate)  # fmt: skip


MODELS: dict[str, ModelSpec] = {
    # (intermediate: config.json's intermediate_size, a MoE model's moe_intermediate_size)
    # Qwen/Qwen2.5-1.5B: card 1.54B params; config 28 layers, hidden 1536, 12 heads, 2 kv heads,
    # vocab 151936, tie_word_embeddings true. A small GenRM.
    "Qwen2.5-1.5B": _qwen25("Qwen2.5-1.5B", 1.54e9, 28, 1536, 12, 2, 151936, True, 8960),
    # Qwen/Qwen2.5-3B: card 3.09B; config 36 layers, hidden 2048, 16 heads, 2 kv heads, vocab 151936, tied
    "Qwen2.5-3B": _qwen25("Qwen2.5-3B", 3.09e9, 36, 2048, 16, 2, 151936, True, 11008),
    # Qwen/Qwen2.5-7B: card 7.61B; config 28 layers, hidden 3584, 28 heads, 4 kv heads, vocab 152064, untied
    "Qwen2.5-7B": _qwen25("Qwen2.5-7B", 7.61e9, 28, 3584, 28, 4, 152064, False, 18944),
    # Qwen/Qwen2.5-14B: card 14.7B; config 48 layers, hidden 5120, 40 heads, 8 kv heads, vocab 152064, untied
    "Qwen2.5-14B": _qwen25("Qwen2.5-14B", 14.7e9, 48, 5120, 40, 8, 152064, False, 13824),
    # Qwen/Qwen2.5-32B: card 32.5B; config 64 layers, hidden 5120, 40 heads, 8 kv heads, vocab 152064, untied
    "Qwen2.5-32B": _qwen25("Qwen2.5-32B", 32.5e9, 64, 5120, 40, 8, 152064, False, 27648),
    # Qwen/Qwen3-30B-A3B: card 30.5B total, 3.3B activated; config 48 layers, hidden 2048, 32 heads,
    # 4 kv heads, head_dim 128, vocab 151936, untied, num_experts 128, num_experts_per_tok 8
    "Qwen3-30B-A3B": ModelSpec(
        "Qwen3-30B-A3B", 30.5e9, 3.3e9, 48, 2048, 32, 4, 128, 151936, False, 128, 8, intermediate=768
    ),
    # Qwen/Qwen3-235B-A22B: card 235B total, 22B activated; config 94 layers, hidden 4096, 64 heads,
    # 4 kv heads, head_dim 128, vocab 151936, untied, num_experts 128, num_experts_per_tok 8
    "Qwen3-235B-A22B": ModelSpec(
        "Qwen3-235B-A22B", 235e9, 22e9, 94, 4096, 64, 4, 128, 151936, False, 128, 8, intermediate=1536
    ),
}


def get_model(name: str) -> ModelSpec:
    """The spec named ``name``; an unknown name fails with the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
