"""A Llama-family decoder (RoPE, RMSNorm, SwiGLU, grouped-query attention), in the shape of
Hugging Face's ``LlamaForCausalLM``: the parameter names are theirs one-to-one
(``model.layers.0.self_attn.q_proj.weight``...), so an export is a rename-free save and a
Hugging Face checkpoint of the same shapes loads as it is.

Our own compact module rather than ``transformers``: a volunteer installs torch and nothing
of transformers' size, and a training step is these few kernels (attention through
``scaled_dot_product_attention``) without a generic model's per-call bookkeeping. Numerics
follow transformers where they could differ: RoPE in the rotate-half layout with fp32
inverse frequencies, RMSNorm computed in fp32, keys and values repeated per query group
(``repeat_kv``). tests/test_llama.py pins our logits to theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from diloco.model.gpt import LanguageModel


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    intermediate_size: int
    block_size: int
    vocab_size: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def swiglu_width(n_embd: int) -> int:
    """The SwiGLU hidden width Llama uses by default: 8/3 of the model width, rounded up to
    a multiple of 64."""
    return 64 * math.ceil(8 * n_embd / 3 / 64)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    """cos and sin of the rotary angles for positions 0..T-1 (not parameters: rebuilt)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / (theta**exponent), persistent=False)
        self.theta, self.head_dim = theta, head_dim

    def reset(self) -> None:
        """Recompute the frequencies (after ``to_empty``, which leaves buffers garbage)."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        self.inv_freq = (1.0 / (self.theta**exponent)).to(self.inv_freq.device)

    def forward(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        pos = torch.arange(T, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.float().to(device))  # (T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, hd
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * hd, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * hd, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin  # (B, nh, T, hd)
        k = k * cos + rotate_half(k) * sin  # (B, nkv, T, hd)
        groups = self.n_head // self.n_kv_head
        if groups > 1:  # every query head of a group reads its group's key/value head
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """``model.*`` of a LlamaForCausalLM: embeddings, layers, final norm."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        cos, sin = self.rotary(idx.shape[1], idx.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Llama(LanguageModel):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.n_head % cfg.n_kv_head or cfg.n_embd % cfg.n_head or cfg.head_dim % 2:
            raise ValueError(f"inconsistent Llama shape: {cfg}")
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.apply(self._init_weights)
        # as the GPT: residual projections scaled by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def tie_weights(self) -> None:
        """Share the embedding with the head when the config ties them (again after
        ``to_empty``, which gives every parameter its own memory), and rebuild the rotary
        frequencies, which ``to_empty`` leaves uninitialised."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.model.rotary.reset()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab), or the mean cross-entropy when ``targets`` is given."""
        T = idx.shape[1]
        if self.cfg.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        logits = self.lm_head(self.model(idx))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
