"""Our Llama against transformers' LlamaForCausalLM: the same names, shapes and logits."""

from __future__ import annotations

import pytest
import torch

from diloco.config import ConfigError, InnerSection, ModelSection, parse_config
from diloco.model.architectures import build_model, llama_config, parameter_shapes
from diloco.train import InnerTrainer, parameters_of

transformers = pytest.importorskip("transformers")


def section(**over: object) -> ModelSection:
    base = {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64,
            "block_size": 32, "vocab_size": 97}  # fmt: skip
    return ModelSection.model_validate(base | over)


def hf_twin(sec: ModelSection, ours: torch.nn.Module) -> torch.nn.Module:
    """transformers' model of the same shape, holding our weights."""
    c = llama_config(sec)
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
        num_key_value_heads=c.n_kv_head, max_position_embeddings=c.block_size,
        rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings,
        attention_bias=False, mlp_bias=False,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).float().eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"} and (not missing or c.tie_embeddings), missing
    return hf


@pytest.mark.parametrize(
    "over",
    [{}, {"tie_embeddings": True}, {"n_kv_head": 4}, {"n_kv_head": 1, "rope_theta": 500000.0}],
    ids=["gqa", "tied", "mha", "mqa-theta"],
)
def test_logits_equal_transformers_llama(over):
    torch.manual_seed(0)
    sec = section(**over)
    ours = build_model(sec).eval()
    hf = hf_twin(sec, ours)
    idx = torch.randint(0, sec.vocab, (3, sec.block_size))

    with torch.no_grad():
        diff = (ours(idx) - hf(input_ids=idx).logits).abs().max().item()

    assert diff <= 1e-4, diff
    theirs = {n for n, _ in hf.named_parameters()}
    assert set(parameters_of(ours)) == theirs  # tied: lm_head is the embedding, in both


def test_parameter_names_are_hugging_faces_and_shapes_follow_the_config():
    shapes = parameter_shapes(section(intermediate_size=96))
    assert shapes["model.embed_tokens.weight"] == (97, 64)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (2 * 16, 64)  # 2 kv heads of 16
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (96, 64)
    assert shapes["lm_head.weight"] == (97, 64)
    assert "lm_head.weight" not in parameter_shapes(section(tie_embeddings=True))
    # the SwiGLU default: 8/3 of the width rounded up to a multiple of 64
    assert parameter_shapes(section())["model.layers.0.mlp.up_proj.weight"] == (192, 64)


def test_a_few_adamw_steps_lower_the_loss():
    torch.manual_seed(1)
    sec = section()
    inner = InnerSection(steps=20, batch_size=4, lr=3e-3, warmup_steps=0, schedule="constant")
    trainer = InnerTrainer(build_model(sec), inner, total_steps=20, device=torch.device("cpu"))
    batch = torch.randint(0, 97, (4, 33))  # one batch, memorised
    result = trainer.run(20, start_step=0, next_batch=lambda: (batch[:, :-1], batch[:, 1:]))
    assert result.losses[-1] < 0.7 * result.losses[0], result.losses


def test_meta_built_model_is_whole_after_to_empty_and_tie_weights():
    torch.manual_seed(2)
    sec = section(tie_embeddings=True)
    ref = build_model(sec).eval()
    with torch.device("meta"):
        model = build_model(sec)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        assert torch.equal(model.eval()(idx), ref(idx))  # rotary buffers rebuilt, head tied


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"n_kv_head": 2}, r'model.n_kv_head: only for arch = "llama"'),
        ({"tie_embeddings": False}, r"model.tie_embeddings: arch = \"gpt\" always ties"),
        ({"arch": "llama", "n_head": 4, "n_kv_head": 3}, r"model.n_kv_head: n_head \(4\) must"),
        ({"arch": "llama", "n_head": 8, "n_embd": 8}, r"model.n_head: RoPE needs an even head"),
        ({"arch": "bert"}, r"model.arch: Input should be 'gpt' or 'llama'"),
    ],
)
def test_config_refuses_shapes_the_architecture_cannot_take(model, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"name": "x", "data": {"path": "a.txt"}, "model": model})


def test_the_byte_level_gpt_exports_as_gpt2_with_the_same_logits(tmp_path):
    from diloco.model.hf import write_hf_dir

    torch.manual_seed(3)
    sec = ModelSection(n_layer=2, n_head=2, n_embd=32, block_size=16)
    ours = build_model(sec).eval()
    from diloco.data.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer(eod=False).to_json()  # what a text run exports: ids are bytes
    write_hf_dir(tmp_path, sec, parameters_of(ours), tokenizer_json=tokenizer, eod_id=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    idx = torch.randint(0, 256, (2, 16))

    with torch.no_grad():
        diff = (ours(idx) - hf.eval()(input_ids=idx).logits).abs().max().item()

    assert type(hf).__name__ == "GPT2LMHeadModel" and diff <= 1e-4, diff
    assert hf_tok("hé ROMEO")["input_ids"] == list("hé ROMEO".encode())
