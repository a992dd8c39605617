"""Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder in plain torch.

The engine and the trainer both run this module, so rollout log-probs and
training log-probs come from one implementation. Two entry points:

* ``model(input_ids)`` - full causal forward over right-padded rows, logits
  ``[B, T, V]`` (training, evaluation, parity tests).
* ``model.forward_cached(...)`` - a chunk of new tokens per row appended to a
  slotted KV cache (prefill and decode of the generation engine).

Parameter names match Hugging Face checkpoints one to one, except the experts
of a sparse layer, which are stacked; their ``state_dict`` speaks the
checkpoints' per-expert names (:mod:`pivotrl.model.experts`), so a safetensors
state dict loads without renaming.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pivotrl.model.config import ModelConfig
from pivotrl.model.experts import Experts

LOGIT_CHUNK_TOKENS = 1024  # positions whose logits exist at once when scoring tokens (x vocab x 4 bytes)


def _chunk_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float) -> Tensor:
    logits = F.linear(hidden, weight).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def chunked_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, chunk: int = LOGIT_CHUNK_TOKENS
) -> Tensor:
    """``log p(targets[i] | hidden[i])`` in float32 for ``hidden [N, H]`` against the output embedding ``[V, H]``.

    Why chunks: at a 152k vocabulary the float32 logits of 1,000 positions are
    0.6 GB, and of a whole micro batch tens of GB. Each chunk's logits live only
    while its log-probs are computed; under autograd the chunk is checkpointed,
    so backward recomputes its logits instead of keeping them, and no
    ``[N, V]`` tensor ever exists. Values equal the full computation's.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if grad:
            parts.append(checkpoint(_chunk_logprobs, h, weight, t, temperature, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(h, weight, t, temperature))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def attend(q: Tensor, k: Tensor, v: Tensor, expand: bool | None = None, **kwargs: Any) -> Tensor:
    """Scaled dot-product attention of ``q`` [B, H, T, D] over ``k``, ``v`` [B, Hkv, K, D], each key head serving
    H / Hkv query heads in a row. On CUDA, SDPA runs such grouped heads in its flash kernel only (bf16 or fp16,
    no mask); with a mask (the engine's cache) or in fp32 it would take the math kernel, which writes out every
    score, B x H x T x K (3.7 GB for one 8k-token prefill of 28 heads in bf16). There ``k`` and ``v`` are
    repeated per query head instead, so the memory-efficient kernel runs. ``expand``: force either way."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    if expand is None:
        expand = q.is_cuda and (kwargs.get("attn_mask") is not None or q.dtype == torch.float32)
    if expand:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class KVCache:
    """Keys and values per sequence slot: ``[layers, slots, kv_heads, max_len, head_dim]``.

    A slot belongs to one running sequence; its first ``length`` positions are
    valid. The engine owns slot assignment; this class only holds storage.
    """

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots = slots
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class CacheWrite:
    """Where one forward_cached call reads and writes the cache (shared by all layers)."""

    def __init__(self, slots: Tensor, positions: Tensor, valid: Tensor, key_len: int) -> None:
        self.slots = slots  # [B]
        self.positions = positions  # [B, T] absolute positions of the new tokens
        self.valid = valid  # [B, T] bool: real token (not padding)
        self.key_len = key_len  # keys 0..key_len-1 are read
        self.all_valid = bool(valid.all())
        if not self.all_valid:
            self.flat_slots = slots[:, None].expand_as(positions)[valid]
            self.flat_pos = positions[valid]
        # query at position p attends keys 0..p
        keys = torch.arange(key_len, device=positions.device)
        self.mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, K]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None, where: CacheWrite | None = None
    ) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is None:
            out = attend(q, k, v, is_causal=True)
        else:
            assert where is not None
            ck, cv = cache.k[self.layer], cache.v[self.layer]  # [S, Hkv, L, D]
            kt, vt = k.transpose(1, 2).to(ck.dtype), v.transpose(1, 2).to(cv.dtype)  # [B, T, Hkv, D]
            if where.all_valid:
                idx = (where.slots[:, None].expand_as(where.positions), slice(None), where.positions)
                ck[idx], cv[idx] = kt, vt
            else:
                ck[where.flat_slots, :, where.flat_pos] = kt[where.valid]
                cv[where.flat_slots, :, where.flat_pos] = vt[where.valid]
            # index_select, not ck[slots, :, :n]: same values, ~7x faster on CPU (advanced indexing is elementwise)
            keys = ck[:, :, : where.key_len].index_select(0, where.slots).to(q.dtype)
            vals = cv[:, :, : where.key_len].index_select(0, where.slots).to(q.dtype)
            out = attend(q, keys, vals, attn_mask=where.mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Qwen3-MoE's sparse block: the router (``gate``) scores every expert, each token goes through its
    ``top_k`` best, and their outputs add up weighted by the router's softmax probabilities (float32; over
    all experts, then renormalised over the chosen k when ``norm_topk_prob``), as transformers computes them.
    The experts run grouped (:class:`pivotrl.model.experts.Experts`).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = route(self.gate, x, self.top_k, self.norm_topk_prob)
        return self.experts(x, chosen, weights).view(shape)


def route(gate: nn.Linear, x: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """The router of tokens ``x`` [N, H]: each token's ``top_k`` experts [N, k] and their weights (the softmax
    probabilities in float32, renormalised over the chosen k when ``norm_topk_prob``), in ``x``'s dtype."""
    probs = F.softmax(gate(x), dim=-1, dtype=torch.float32)
    weights, chosen = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), chosen


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, index)
        dense = not cfg.is_sparse_layer(index)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias) if dense else SparseMoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None, where: CacheWrite | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, where)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    """Causal LM: ``model(input_ids) -> logits [B, T, V]``, or the log-probs of chosen tokens.

    ``checkpoint_layers`` (activation checkpointing): training keeps only each
    layer's input and recomputes the layer in backward, trading a second
    forward for activations that no longer grow with the number of layers.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.checkpoint_layers = False
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", torch.tensor(cfg.inv_freq(), dtype=torch.float32), persistent=False)

    @classmethod
    def empty(cls, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> Decoder:
        """A model with allocated but unset weights, for loading into: built on the meta
        device (no initialisation work), then given real storage, tied embeddings and the
        RoPE table (a buffer not stored in checkpoints)."""
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to(dtype).to_empty(device=device)  # (cast on meta: storage is allocated once, in dtype)
        if cfg.tie_word_embeddings:  # to_empty gives each parameter its own storage: tie again
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = torch.tensor(cfg.inv_freq(), dtype=torch.float32, device=device)
        return model

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        angles = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def hidden(self, input_ids: Tensor) -> Tensor:
        """Final hidden states of a full causal forward, ``[B, T, H]``."""
        b, t = input_ids.shape
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        cos, sin = self._rope(positions, x.dtype)
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for layer in self.model.layers:
            if recompute:
                x = checkpoint(layer, x, cos, sin, None, None, use_reentrant=False)
            else:
                x = layer(x, cos, sin, None, None)
        return self.model.norm(x)

    def forward(
        self, input_ids: Tensor, score: Tensor | None = None, temperature: float = 1.0, chunk: int = LOGIT_CHUNK_TOKENS
    ) -> Tensor:
        """Logits ``[B, T, V]``; or, with ``score`` (bool ``[B, T - 1]``, the next-token frame), the float32
        log-probs of the next token at each scored position, ``log p(input_ids[b, t + 1] | input_ids[b, :t + 1])``,
        flat in row-major order.

        Scoring happens inside ``forward`` (not by the caller on the logits) so
        that a sharded trainer, whose output embedding exists in full only
        while ``forward`` runs, can use it; see :func:`chunked_logprobs`.
        """
        hidden = self.hidden(input_ids)
        if score is None:
            return self.lm_head(hidden)
        targets = input_ids[:, 1:][score]
        return chunked_logprobs(hidden[:, :-1][score], self.lm_head.weight, targets, temperature, chunk)

    def forward_cached(
        self, input_ids: Tensor, start: Tensor, lengths: Tensor, slots: Tensor, cache: KVCache
    ) -> Tensor:
        """Append ``lengths[b]`` new tokens of row b to cache slot ``slots[b]``.

        ``input_ids`` is ``[B, T]`` right-padded; row b's tokens sit at absolute
        positions ``start[b] ..``. Returns the logits of each row's last new
        token, ``[B, V]``.
        """
        b, t = input_ids.shape
        offs = torch.arange(t, device=input_ids.device)
        positions = start[:, None] + offs[None, :]
        valid = offs[None, :] < lengths[:, None]
        key_len = int((start + lengths).max())
        if key_len > cache.max_len:
            raise ValueError(f"sequence of {key_len} tokens exceeds the KV cache length {cache.max_len}")
        where = CacheWrite(slots, positions, valid, key_len)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, where)
        last = x[torch.arange(b, device=x.device), lengths - 1]
        return self.lm_head(self.model.norm(last))
