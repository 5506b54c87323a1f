"""A version's eval with one module's parameters in memory at a time
(``diloco.model.streamed``): the very loss of the model read whole, for both architectures,
tied or not, of a version's parameters and of a step not yet written (base + delta)."""

from __future__ import annotations

import pytest
import torch

from diloco.checkpoint import write_params
from diloco.config import ModelSection
from diloco.model.architectures import build_model
from diloco.model.streamed import StreamedVersion
from diloco.train import evaluate, load_version_files, parameters_of
from diloco.wire import delta as deltas
from diloco.wire.codec import Int8Codec

SECTIONS = {
    "gpt": ModelSection(n_layer=2, n_head=2, n_embd=32, block_size=16),
    "llama": ModelSection(
        arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16, vocab_size=64
    ),
    "llama-untied": ModelSection(
        arch="llama",
        n_layer=2,
        n_head=2,
        n_embd=32,
        block_size=16,
        vocab_size=64,
        tie_embeddings=False,
    ),
}


@pytest.mark.parametrize("kind", list(SECTIONS))
def test_the_streamed_eval_is_the_whole_models_loss_of_a_version_and_of_a_step(tmp_path, kind):
    # Prepare: a version's parameters and a delta from it, written as the server writes them
    section = SECTIONS[kind]
    torch.manual_seed(0)
    model = build_model(section)
    params = {n: p.detach().clone() for n, p in parameters_of(model).items()}
    write_params(tmp_path / "p", params, version=1)
    gen = torch.Generator().manual_seed(1)
    encoded = {
        n: deltas.publish_change(0.05 * torch.randn(t.shape, generator=gen), Int8Codec(64))[0]
        for n, t in params.items()
    }
    deltas.write_delta(tmp_path / "d", encoded, run_id="r", version=2, base_version=1,
                       codec=Int8Codec(64))  # fmt: skip
    vocab = section.vocab
    val = torch.randint(0, vocab, (16 * 6 + 1,), generator=gen)

    for delta in (None, tmp_path / "d"):
        # Execute
        with StreamedVersion(section, tmp_path / "p", delta) as version:
            got = evaluate(version.model, val, block_size=16, device=torch.device("cpu"))
            # Assert: nothing of the model is held once the forward is done
            assert all(p.is_meta for p in version.model.parameters())

        # Assert: the loss of the whole model read into memory, to the bit
        whole = build_model(section)
        load_version_files(whole, tmp_path / "p", delta)
        assert got == evaluate(whole, val, block_size=16)


def test_a_parameters_file_of_another_model_is_refused(tmp_path):
    small, other = SECTIONS["gpt"], ModelSection(n_layer=2, n_head=2, n_embd=16, block_size=16)
    write_params(tmp_path / "p", dict(parameters_of(build_model(other))), version=1)
    with (
        StreamedVersion(small, tmp_path / "p") as version,
        pytest.raises(ValueError, match="is not"),
    ):
        evaluate(version.model, torch.zeros(33, dtype=torch.long), block_size=16)
