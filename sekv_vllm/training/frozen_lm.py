"""The frozen base model (Hugging Face transformers, float32, no gradients), opened layer by layer.

Llama-family decoders (llama, mistral, qwen2): the teacher runs them whole; the student runs
their layers one at a time for a few query tokens with its own attention.
"""
from __future__ import annotations

import math

import torch

from sekv_vllm.router import ModelShape

SUPPORTED = ("llama", "mistral", "qwen2")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class FrozenLM:
    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        cfg = self.model.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"model: router training supports {SUPPORTED} decoders, not {cfg.model_type!r}")
        self.model.eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.layers = self.model.model.layers
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = ModelShape(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)
        self.scale = 1 / math.sqrt(head_dim)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [n, heads, D] pre-rotary query or key rows at positions pos [n]; returns post-rotary."""
        cos, sin = self.model.model.rotary_emb(x, pos[None])  # [1, n, D]
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        return x * cos + rotate_half(x) * sin

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[rows, n * D] -> [rows, n, D]"""
        return x.view(x.shape[0], n, self.shape.head_dim)

    def logprobs(self, normed: torch.Tensor) -> torch.Tensor:
        """normed: [n, hidden] last-layer states after the final norm -> [n, vocab] log-probs."""
        return torch.log_softmax(self.model.lm_head(normed).float(), dim=-1)
