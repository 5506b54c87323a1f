"""Hugging Face model directories, out and in.

``write_hf_dir`` exports a Llama run as ``LlamaForCausalLM`` (our parameter names are
theirs: no renaming) and a byte-level GPT run as ``GPT2LMHeadModel`` (renamed, and its
linear weights transposed into GPT-2's Conv1D layout), with the run's tokenizer; the
directory loads with ``transformers``' ``AutoModelForCausalLM`` and ``AutoTokenizer``, and
with ``diloco sample``. ``read_hf_dir`` reads a Llama directory back as a ``[model]``
section and our parameters; ``load_initial`` is a run's starting weights, from either our
safetensors or such a directory, checked against the run's shapes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diloco.config import ModelSection
from diloco.model.architectures import llama_config, parameter_shapes

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"


class HFError(ValueError):
    """A directory or weights file that cannot be used as asked; the message says why."""


def _llama_config_json(section: ModelSection, eod_id: int | None) -> dict[str, Any]:
    c = llama_config(section)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.block_size,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "bos_token_id": eod_id,
        "eos_token_id": eod_id,
    }


def _gpt2(section: ModelSection, params: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """GPT-2's config and weights for our byte-level GPT (same maths: pre-norm blocks,
    learned positions, exact GELU, tied head)."""
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": section.vocab,
        "n_positions": section.block_size,
        "n_embd": section.n_embd,
        "n_layer": section.n_layer,
        "n_head": section.n_head,
        "n_inner": 4 * section.n_embd,
        "activation_function": "gelu",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    top = ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")
    names = {name: f"transformer.{name}" for name in top}
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if name in names:
            out[names[name]] = t
            continue
        _, i, rest = name.split(".", 2)  # blocks.{i}.{rest}
        hf = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc",
              "mlp.proj": "mlp.c_proj"}  # fmt: skip
        module, leaf = rest.rsplit(".", 1)
        target = f"transformer.h.{i}.{hf.get(module, module)}.{leaf}"
        # Conv1D keeps (in, out): our Linear weights are (out, in)
        out[target] = t.t().contiguous() if module in hf and leaf == "weight" else t
    return config, out


def write_hf_dir(
    out: Path,
    section: ModelSection,
    params: Mapping[str, torch.Tensor],
    *,
    tokenizer_json: str | None,
    eod_id: int | None,
) -> None:
    """``config.json``, ``generation_config.json``, ``model.safetensors`` (fp32) and, given
    one, the tokenizer (``tokenizer.json`` byte for byte, and its config) into ``out``."""
    expected = parameter_shapes(section)
    if {n: tuple(t.shape) for n, t in params.items()} != expected:
        raise HFError("the parameters do not have the run's names and shapes")
    if section.arch == "llama":
        config = _llama_config_json(section, eod_id)
        tensors = {n: t.float().contiguous() for n, t in params.items()}
    else:
        config, tensors = _gpt2(section, {n: t.float() for n, t in params.items()})
        config |= {"bos_token_id": eod_id, "eos_token_id": eod_id}
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    generation = {"bos_token_id": eod_id, "eos_token_id": eod_id, "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    if tokenizer_json is None:
        return
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    special: dict[str, str] = {}
    if eod_id is not None:
        vocab = json.loads(tokenizer_json).get("added_tokens", [])
        token = next((t["content"] for t in vocab if t.get("id") == eod_id), None)
        if token is not None:
            special = {"bos_token": token, "eos_token": token, "unk_token": token}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": section.block_size,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _section_of(config: Mapping[str, Any], where: Path) -> ModelSection:
    if config.get("model_type") != "llama" and "LlamaForCausalLM" not in config.get(
        "architectures", []
    ):
        raise HFError(
            f"{where}: a {config.get('model_type') or config.get('architectures')} model; only "
            "Llama-family directories (model_type llama) can start a run"
        )
    try:
        return ModelSection.model_validate(
            {
                "arch": "llama",
                "n_layer": config["num_hidden_layers"],
                "n_head": config["num_attention_heads"],
                "n_kv_head": config.get("num_key_value_heads", config["num_attention_heads"]),
                "n_embd": config["hidden_size"],
                "block_size": config.get("max_position_embeddings", 2048),
                "intermediate_size": config["intermediate_size"],
                "rope_theta": float(config.get("rope_theta", 10_000.0)),
                "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
                "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
                "vocab_size": config["vocab_size"],
            }
        )
    except KeyError as err:
        raise HFError(f"{where}: config.json lacks {err}") from None
    except ValueError as err:
        raise HFError(f"{where}: config.json describes a model we cannot build ({err})") from None


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {n: f.get_tensor(n).float() for n in f.keys()}  # noqa: SIM118
    except (OSError, ValueError) as err:
        raise HFError(f"{path}: not a safetensors file ({err})") from None


def read_hf_dir(folder: Path) -> tuple[ModelSection, dict[str, torch.Tensor]]:
    """A Llama directory's ``[model]`` section and fp32 parameters (single or sharded
    safetensors)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFError(f"{folder}: no config.json (is it a Hugging Face model directory?)") from None
    section = _section_of(config, folder)
    if (folder / WEIGHTS).is_file():
        params = _read_safetensors(folder / WEIGHTS)
    elif (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text(encoding="utf-8"))
        params = {}
        for shard in sorted(set(index.get("weight_map", {}).values())):
            params |= _read_safetensors(folder / shard)
    else:
        raise HFError(f"{folder}: no {WEIGHTS} or {INDEX} (only safetensors weights are read)")
    return section, params


def load_initial(path: Path, section: ModelSection) -> dict[str, torch.Tensor]:
    """A run's starting weights from our safetensors file or a Hugging Face directory,
    checked against ``section``: the same architecture and every name, shape and value
    (finite) the run's model has."""
    path = Path(path)
    if path.is_dir():
        theirs, params = read_hf_dir(path)
        for key in ("arch", "n_layer", "n_head", "n_embd", "vocab_size", "tie_embeddings"):
            ours_v, theirs_v = getattr(section, key), getattr(theirs, key)
            if key == "tie_embeddings":
                ours_v, theirs_v = bool(ours_v), bool(theirs_v)
            if ours_v != theirs_v:
                raise HFError(f"model.{key}: the run says {ours_v}, {path} has {theirs_v}")
    elif path.is_file():
        params = _read_safetensors(path)
        params = {n: t for n, t in params.items() if not n.startswith("outer.")}  # our state
    else:
        raise HFError(f"model.init: {path} does not exist")
    expected = parameter_shapes(section)
    if "lm_head.weight" in params and "lm_head.weight" not in expected:  # a tied model saved whole
        head = params.pop("lm_head.weight")
        if not torch.equal(head, params.get("model.embed_tokens.weight", head + 1)):
            raise HFError("model.init: lm_head differs from the embedding of a tied model")
    missing, extra = expected.keys() - params.keys(), params.keys() - expected.keys()
    if missing or extra:
        raise HFError(
            f"model.init: the weights do not fit the run's model (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(extra)[:5]})"
        )
    for name, shape in expected.items():
        if tuple(params[name].shape) != shape:
            raise HFError(
                f"model.init: {name} has shape {tuple(params[name].shape)}, the run's model {shape}"
            )
        if not bool(torch.isfinite(params[name]).all()):
            raise HFError(f"model.init: {name} holds NaN or Inf")
    return {name: params[name].contiguous() for name in expected}
