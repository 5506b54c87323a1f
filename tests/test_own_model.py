"""Train your own model, end to end with real processes (issue 14's acceptance):

`diloco data prepare` with a BPE tokenizer trained locally on a corpus, `diloco run create`
of a Llama run on that dataset (uploaded by the CLI), two `diloco join` volunteers through
a real `diloco serve`, `diloco run export` to a Hugging Face directory, which
`transformers` loads: its logits equal ours, its held-out loss is below the untrained
model's, and `diloco sample` generates text from it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from diloco.checkpoint import checkpoint_params_only
from diloco.config import load_config
from diloco.data.manifest import read_manifest
from diloco.model.architectures import build_model
from diloco.train import load_parameters
from tests.support.contribute import API
from tests.support.corpora import TINYSHAKESPEARE
from tests.support.live import ADMIN_TOKEN, ServerProcess
from tests.support.volunteers import Volunteers, create_run

ROUNDS = 4
BLOCK = 64


def diloco(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "client.cli", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert out.returncode == 0, f"diloco {' '.join(args)}: {out.stdout}\n{out.stderr}"
    return out


@pytest.fixture
def server(database_url: str, tmp_path: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(data_dir=tmp_path / "srv", database_url=database_url)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture
def volunteers(tmp_path: Path) -> Iterator[Volunteers]:
    v = Volunteers(tmp_path / "volunteers")
    yield v
    v.stop_all()


def write_config(path: Path, dataset: Path) -> Path:
    path.write_text(
        f"""name = "own-llama"
seed = 7
[model]
arch = "llama"
n_layer = 2
n_head = 4
n_kv_head = 2
n_embd = 64
block_size = {BLOCK}
[data]
dataset = "{dataset}"
[inner]
steps = 20
batch_size = 8
lr = 3e-3
warmup_steps = 5
schedule = "constant"
[rounds]
quorum = 2
target = 2
timeout_s = 120
max_rounds = {ROUNDS}
heartbeat_interval_s = 1
"""
    )
    return path


def held_out(dataset: Path, windows: int) -> torch.Tensor:
    """The first ``windows`` windows of BLOCK + 1 tokens of the validation file, int64."""
    manifest = read_manifest(dataset)
    tokens = np.fromfile(dataset / "val.bin", dtype=manifest.dtype)
    assert tokens.size >= windows * BLOCK + 1, "the validation file is too short for the test"
    rows = [tokens[i * BLOCK : i * BLOCK + BLOCK + 1] for i in range(windows)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def hf_loss(model: torch.nn.Module, batch: torch.Tensor) -> float:
    """Mean next-token cross-entropy of a transformers model on (B, T + 1) windows."""
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))


@pytest.mark.slow
def test_prepare_train_export_load_and_sample(server, volunteers, tmp_path):
    transformers = pytest.importorskip("transformers")
    # Prepare: a BPE tokenizer trained here, a tokenized dataset, a Llama run on it
    dataset = tmp_path / "dataset"
    diloco(
        "data", "prepare", str(TINYSHAKESPEARE), "--out", str(dataset),
        "--tokenizer", "train:512", "--shard-tokens", "65536", "--quiet",
    )  # fmt: skip
    manifest = read_manifest(dataset)
    assert manifest.tokenizer.kind == "bpe" and manifest.tokenizer.vocab_size == 512
    config = write_config(tmp_path / "run.toml", dataset)
    run_id = create_run(server, config)
    for name in ("v1", "v2"):
        volunteers.start(name, server, run_id)
    http = httpx.Client(base_url=server.url, timeout=30)

    # Execute: the run trains to its end; export the first and the last version
    volunteers.finish(http, run_id, timeout=600)
    trained, untrained = tmp_path / "export", tmp_path / "export-v0"
    common = ("--server", server.url, "--admin-token", ADMIN_TOKEN)
    diloco("run", "export", run_id, *common, "--out", str(trained))
    diloco("run", "export", run_id, *common, "--out", str(untrained), "--version", "0")

    # Assert: transformers loads model and tokenizer; its logits are ours
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained, torch_dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(trained)
    assert type(hf).__name__ == "LlamaForCausalLM"
    cfg = load_config(config).model.model_copy(update={"vocab_size": 512})
    ours = build_model(cfg)
    version = http.get(f"{API}/runs/{run_id}").json()["checkpoint_version"]
    assert version == ROUNDS
    params = tmp_path / "params.safetensors"
    params.write_bytes(http.get(f"{API}/runs/{run_id}/checkpoints/{version}").content)
    load_parameters(ours, {n: t.float() for n, t in checkpoint_params_only(params).items()})
    ours.eval()
    batch = held_out(dataset, windows=8)
    with torch.no_grad():
        diff = (ours(batch[:, :-1]) - hf(input_ids=batch[:, :-1]).logits).abs().max().item()
    assert diff <= 1e-4, diff
    # the tokenizer is the dataset's: the same ids for the same text
    text = "ROMEO:\nBut soft, what light through yonder window breaks?"
    from tokenizers import Tokenizer

    assert (
        hf_tok(text)["input_ids"]
        == Tokenizer.from_file(str(dataset / "tokenizer.json")).encode(text).ids
    )
    # trained beats untrained on held-out text
    hf0 = transformers.AutoModelForCausalLM.from_pretrained(untrained, torch_dtype=torch.float32)
    loss, loss0 = hf_loss(hf, batch), hf_loss(hf0, batch)
    assert loss < loss0 - 0.5, (loss, loss0)
    # coverage: the accepted contributions' tokens are counted
    coverage = http.get(f"{API}/runs/{run_id}/coverage").json()
    assert coverage["tokens_trained"] >= 2 * ROUNDS * 20 * 8 * BLOCK, coverage
    print(f"logits max abs diff {diff:.2e}; held-out loss {loss:.3f} trained vs {loss0:.3f} "
          f"untrained; coverage {coverage}")  # fmt: skip
    shown = diloco("run", "show", run_id, "--server", server.url).stdout
    assert f"{coverage['tokens_trained']:,} trained ({coverage['epochs']:.2f} epochs)" in shown
    # and it generates text, with our sampler
    out = diloco("sample", str(trained), "--prompt", "ROMEO:", "--max-new-tokens", "30")
    assert out.stdout.startswith("ROMEO:") and len(out.stdout.strip()) > len("ROMEO:") + 10
    print(f"diloco sample: {out.stdout!r}")
    assert json.loads((trained / "config.json").read_text())["num_key_value_heads"] == 2
