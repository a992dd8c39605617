"""Architecture description read from a Hugging Face ``config.json``.

One decoder covers the Llama, Qwen2 and Qwen3 families; they differ only in a
few switches (attention bias, q/k norm, head_dim, tied embeddings, RoPE
scaling). Qwen3-MoE is Qwen3 with a mixture of experts in place of the MLP in
some layers (``num_experts`` > 0; which layers: ``is_sparse_layer``).
Everything else in a config.json is ignored (the router's auxiliary loss too:
it only enters a supervised loss, never the logits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pivotrl.errors import UserError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MOE_FAMILIES = ("qwen3_moe",)
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class UnsupportedModelError(UserError, ValueError):
    """A checkpoint this decoder cannot run; the message says what is supported (the user's to fix: one line,
    exit 2, as ``CheckpointError``)."""


@dataclass(slots=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # llama3 parameters when used
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    # mixture of experts (Qwen3-MoE); num_experts 0: every layer has the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's MLP width (intermediate_size: the dense layers')
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here

    def __post_init__(self) -> None:
        if self.num_experts < 0:
            raise UnsupportedModelError(f"invalid num_experts {self.num_experts}; allowed: >= 0 (0: no experts)")
        if self.num_experts == 0:
            return
        if self.family not in MOE_FAMILIES:
            with_experts = ", ".join(a for a, f in SUPPORTED_ARCHITECTURES.items() if f in MOE_FAMILIES)
            raise UnsupportedModelError(
                f"{self.architecture} has no experts (num_experts={self.num_experts}); with experts: {with_experts}"
            )
        e, k, layers = self.num_experts, self.num_experts_per_tok, self.num_hidden_layers
        checks = (  # (field, value, valid, what is allowed)
            ("num_experts_per_tok", k, 1 <= k <= e, f"1..num_experts ({e})"),
            ("moe_intermediate_size", self.moe_intermediate_size, self.moe_intermediate_size > 0, "> 0"),
            ("decoder_sparse_step", self.decoder_sparse_step, self.decoder_sparse_step >= 1, ">= 1"),
            (
                "mlp_only_layers",
                self.mlp_only_layers,
                all(0 <= i < layers for i in self.mlp_only_layers),
                f"layer indices 0..{layers - 1}",
            ),
        )
        for name, value, valid, allowed in checks:
            if not valid:
                raise UnsupportedModelError(f"invalid {name} {value!r}; allowed: {allowed}")

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer ``index`` routes through experts, by transformers' rule for Qwen3-MoE."""
        return (
            self.num_experts > 0 and index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0
        )

    def num_parameters(self, tp: int = 1, vocab_multiple: int = 1) -> int:
        """All parameters, every expert included (the ones a token uses are fewer). With ``tp`` > 1: those one
        rank of a tensor-parallel engine holds, by vLLM 0.32's cutting rules: the query heads, the MLP's and every
        expert's width and the vocabulary's rows (padded to ``vocab_multiple`` first) cut in ``tp``; each rank
        ``max(1, kv // tp)`` KV heads; norms, an output bias and the router whole."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads // tp * d, max(1, self.num_key_value_heads // tp) * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        per_layer = attn + 2 * h + (2 * d if self.qk_norm else 0)
        width, expert = self.intermediate_size // tp, self.moe_intermediate_size // tp
        dense = 3 * h * width + (2 * width + h if self.mlp_bias else 0)
        sparse = self.num_experts * (3 * h * expert + h)  # experts and their router rows
        mlps = sum(sparse if self.is_sparse_layer(i) else dense for i in range(self.num_hidden_layers))
        rows = -(-self.vocab_size // vocab_multiple) * vocab_multiple // tp
        return self.num_hidden_layers * per_layer + mlps + rows * h * (1 if self.tie_word_embeddings else 2) + h

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(raw.get("model_type", ""))
        if arch is None:
            got = ", ".join(archs) or raw.get("model_type") or "none given"
            raise UnsupportedModelError(
                f"unsupported model architecture {got!r}; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}; supported: 'silu'")
        if raw.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention is not supported (use_sliding_window=true)")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        attn_bias = bool(raw.get("attention_bias", False))
        moe: dict[str, Any] = {}
        if family in MOE_FAMILIES:
            moe = {  # an absent key means what it means to transformers' Qwen3MoeConfig
                # "num_experts" on the Hub; transformers 5 writes its attribute name "num_local_experts"
                "num_experts": raw.get("num_experts", raw.get("num_local_experts", 128)),
                "num_experts_per_tok": raw.get("num_experts_per_tok", 8),
                "moe_intermediate_size": raw.get("moe_intermediate_size", 768),
                "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
                "decoder_sparse_step": raw.get("decoder_sparse_step", 1),
                "mlp_only_layers": list(raw.get("mlp_only_layers") or []),
            }
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type == "llama3" else {},
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            qkv_bias=True if family == "qwen2" else attn_bias,
            o_bias=False if family == "qwen2" else attn_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) if family == "llama" else False,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            **moe,
        )

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json that transformers reads as the same architecture."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
            "torch_dtype": dtype,
        }
        if self.family != "qwen2":
            out["attention_bias"] = self.qkv_bias
        if self.family == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.family in MOE_FAMILIES:
            out |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
            }
        return out

    def inv_freq(self) -> list[float]:
        """RoPE inverse frequencies, with llama3 scaling when configured."""
        dim = self.head_dim
        freqs = [1.0 / (self.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
        if not self.rope_scaling:
            return freqs
        s = self.rope_scaling
        factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_len = s.get("original_max_position_embeddings", self.max_position_embeddings)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        out = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / factor)
            else:
                smooth = (old_len / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        return out
