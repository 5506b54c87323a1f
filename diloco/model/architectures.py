"""The one place a run's ``[model]`` section becomes a module: ``build_model`` and the
parameter shapes every other part checks uploads, checkpoints and memory against.

Both architectures share an interface: ``forward(idx, targets=None)`` (logits, or the mean
cross-entropy), ``tie_weights()`` (again after ``to_empty``), ``num_parameters()``.
"""

from __future__ import annotations

import functools
import math

import torch

from diloco.config import ModelSection
from diloco.model.gpt import GPT, LanguageModel
from diloco.model.llama import Llama, LlamaConfig, swiglu_width


def llama_config(section: ModelSection) -> LlamaConfig:
    """The section's Llama shape, its unset fields at their documented defaults."""
    return LlamaConfig(
        n_layer=section.n_layer,
        n_head=section.n_head,
        n_kv_head=section.kv_heads,
        n_embd=section.n_embd,
        intermediate_size=section.intermediate_size or swiglu_width(section.n_embd),
        block_size=section.block_size,
        vocab_size=section.vocab,
        rope_theta=section.rope_theta if section.rope_theta is not None else 10_000.0,
        norm_eps=section.norm_eps if section.norm_eps is not None else 1e-5,
        tie_embeddings=bool(section.tie_embeddings),
        dropout=section.dropout,
    )


def build_model(section: ModelSection) -> LanguageModel:
    """A freshly initialised model (under the caller's torch seed and default device)."""
    if section.arch == "llama":
        return Llama(llama_config(section))
    return GPT(section.gpt_config())


def empty_model(section: ModelSection) -> LanguageModel:
    """A model whose parameters are to be loaded (no initialisation spent on them): built
    on the meta device, given CPU memory, its weights tied (and a Llama's rotary
    frequencies rebuilt) as ``tie_weights`` does after ``to_empty``."""
    with torch.device("meta"):
        model = build_model(section)
    model.to_empty(device="cpu")
    model.tie_weights()
    return model


@functools.lru_cache(maxsize=64)
def _shapes(section: ModelSection) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with torch.device("meta"):
        model = build_model(section)
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


def parameter_shapes(section: ModelSection) -> dict[str, tuple[int, ...]]:
    """The model's parameter names and shapes, in order (built on the meta device: no
    memory), e.g. what an upload's tensors must be."""
    return dict(_shapes(section))


def parameter_count(section: ModelSection) -> int:
    """The model's number of parameters, from its shapes (nothing allocated)."""
    return sum(math.prod(shape) for _, shape in _shapes(section))


def mlp_width(section: ModelSection) -> int:
    """The hidden width of a block's MLP (what an eval's activations hold per token)."""
    if section.arch == "llama":
        return llama_config(section).intermediate_size
    return 4 * section.n_embd
