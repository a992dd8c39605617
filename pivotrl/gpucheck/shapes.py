"""The model shapes, workloads and timing helpers every GPU check shares.

A section takes its device and its sizes as arguments: on a GPU it runs at the sizes below (a Qwen2-0.5B
shape), in the CPU tests at a tiny one, so a GPU run does not die on a typo.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Shape:
    """A Qwen2-style decoder's size (the tests use a tiny one)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = True

    def hf_config(self) -> Any:
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            max_position_embeddings=4096,
            tie_word_embeddings=self.tied,
            architectures=["Qwen2ForCausalLM"],
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
        )

    def model_config(self) -> Any:
        from pivotrl.model import ModelConfig

        return ModelConfig.from_hf(self.hf_config().to_dict())


QWEN2_05B = Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)
PARITY = Shape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512, vocab=1024, tied=False)
TINY = Shape(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=128)


# ---------------------------------------------------------------------------------------------------------------------
# timing


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes, the device's queued work included."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def peak_memory(device: str) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits: tiny CPU-test sizes and GPU sizes read alike in the report."""
    return float(f"{x:.{digits}g}")


def gb(nbytes: float | None) -> float | None:
    return None if nbytes is None else sig(nbytes / 1e9)


@dataclass(frozen=True, slots=True)
class Workload:
    requests: int = 256
    batch: int = 64
    prompt: tuple[int, int] = (16, 256)  # prompt tokens, uniform in [lo, hi]
    new: tuple[int, int] = (16, 256)  # tokens asked for per request, uniform in [lo, hi]
    seed: int = 0

    def make(self, vocab: int) -> list[tuple[list[int], int]]:
        import torch

        g = torch.Generator().manual_seed(self.seed)
        out = []
        for _ in range(self.requests):
            n = int(torch.randint(self.prompt[0], self.prompt[1] + 1, (), generator=g))
            new = int(torch.randint(self.new[0], self.new[1] + 1, (), generator=g))
            out.append((torch.randint(1, vocab, (n,), generator=g).tolist(), new))
        return out


ENGINE_WORK = Workload()  # the engine sections' requests on a GPU


def random_state(shape: Shape, dtype: str = "float32") -> dict[str, Any]:
    """A model's tensors on the CPU with random values, without building (and initialising) the model."""
    import torch

    from pivotrl.gps import module_tensors
    from pivotrl.model import Decoder

    with torch.device("meta"):
        skeleton = Decoder(shape.model_config())
    g = torch.Generator().manual_seed(0)
    return {
        n: torch.empty(t.shape, dtype=getattr(torch, dtype)).uniform_(-1, 1, generator=g)
        for n, t in module_tensors(skeleton).items()
    }


def tiny_checkpoints(root: Path) -> dict[str, Path]:
    """A random policy and judge over the character tokenizer, as tests/conftest.py builds them (head_dim 32: a
    size every attention backend of vLLM takes, its CPU one included)."""
    import torch

    from pivotrl.model import Decoder, char_tokenizer, save_model

    tok = char_tokenizer()
    paths = {}
    for name, arch, seed in (("policy", "Qwen2ForCausalLM", 0), ("judge", "LlamaForCausalLM", 1)):
        shape = Shape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=tok.vocab_size)
        cfg = replace(
            shape.model_config(),
            architecture=arch,
            qkv_bias=arch == "Qwen2ForCausalLM",
            bos_token_id=tok.bos_token_id,
            eos_token_id=list(tok.eos_token_ids),
        )
        torch.manual_seed(seed)
        model = Decoder(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.3)
        save_model(model, tok, root / name)
        paths[name] = root / name
    return paths


def random_batch(vocab: int, n: int, size: int) -> tuple[list[Any], list[float]]:
    """``n`` random samples of ``size`` tokens, half prompt and half response, with advantages +1 and -1: what
    the trainer sections backpropagate."""
    import torch

    from pivotrl.sample import Sample

    gen = torch.Generator().manual_seed(0)
    out = []
    for uid in range(n):
        ids = torch.randint(1, vocab, (size,), generator=gen).tolist()
        lp = (-torch.rand(size // 2, generator=gen) * 5).tolist()
        out.append(Sample(uid, uid // 4, "", "", ids[: size // 2], 0, response_ids=ids[size // 2 :], logprobs=lp))
    return out, [1.0, -1.0] * (n // 2)
