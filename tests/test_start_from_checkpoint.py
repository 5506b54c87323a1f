"""A run that starts from given weights (``model.init``): our safetensors or a Hugging Face
model directory, checked against the run's model, become checkpoint version 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save_file

from diloco.config import ModelSection
from diloco.model.architectures import build_model, parameter_shapes
from diloco.model.hf import HFError, load_initial, read_hf_dir, write_hf_dir
from diloco.train import parameters_of
from tests.conftest import make_corpus, server_run_config
from tests.support.contribute import API
from tests.support.datasets import make_dataset
from tests.support.live import ADMIN_TOKEN, admin_headers

REPO = Path(__file__).resolve().parents[1]
LLAMA = ModelSection(arch="llama", n_layer=1, n_head=2, n_kv_head=1, n_embd=32, block_size=32,
                     vocab_size=257)  # fmt: skip


def weights(section: ModelSection, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in parameters_of(build_model(section)).items()}


def test_a_hugging_face_directory_reads_back_as_the_same_model_and_weights(tmp_path):
    params = weights(LLAMA, 3)
    write_hf_dir(tmp_path / "hf", LLAMA, params, tokenizer_json=None, eod_id=256)

    section, read = read_hf_dir(tmp_path / "hf")
    loaded = load_initial(tmp_path / "hf", LLAMA)

    assert section.kv_heads == 1 and section.vocab == 257 and section.arch == "llama"
    assert all(torch.equal(read[n], params[n]) for n in params)
    assert all(torch.equal(loaded[n], params[n]) for n in params)


def test_weights_that_do_not_fit_the_run_are_refused_saying_why(tmp_path):
    params = weights(LLAMA, 4)
    write_hf_dir(tmp_path / "hf", LLAMA, params, tokenizer_json=None, eod_id=256)
    wider = LLAMA.model_copy(update={"n_embd": 64})
    nan = dict(params)
    nan["model.norm.weight"] = torch.full_like(params["model.norm.weight"], float("nan"))
    save_file(nan, str(tmp_path / "nan.safetensors"))
    short = {n: t for n, t in params.items() if "mlp" not in n}
    save_file(short, str(tmp_path / "short.safetensors"))
    gpt2 = tmp_path / "gpt2"
    gpt = ModelSection(n_layer=1, n_head=2, n_embd=32, block_size=32)
    write_hf_dir(gpt2, gpt, weights(gpt, 0), tokenizer_json=None, eod_id=None)

    with pytest.raises(HFError, match=r"model.n_embd: the run says 64, .* has 32"):
        load_initial(tmp_path / "hf", wider)
    with pytest.raises(HFError, match=r"model.norm.weight holds NaN or Inf"):
        load_initial(tmp_path / "nan.safetensors", LLAMA)
    with pytest.raises(HFError, match=r"missing \['model.layers.0.mlp.down_proj.weight'"):
        load_initial(tmp_path / "short.safetensors", LLAMA)
    with pytest.raises(HFError, match=r"only Llama-family directories"):
        load_initial(gpt2, gpt)
    with pytest.raises(HFError, match=r"does not exist"):
        load_initial(tmp_path / "nowhere", LLAMA)


def post_run(http, config: dict, init: bytes | None, name: str = "start.safetensors"):
    files = {
        "config": (None, json.dumps(config)),
        "data": ("corpus.txt", make_corpus(60_000).encode(), "text/plain"),
    }
    if init is not None:
        files["init"] = (name, init, "application/octet-stream")
    return http.post(f"{API}/runs", files=files, headers=admin_headers())


def test_the_server_starts_a_run_from_given_weights_and_refuses_ones_that_do_not_fit(
    http, tmp_path
):
    config = server_run_config()
    section = ModelSection.model_validate(config["model"])
    given = weights(section, 9)
    save_file(given, str(tmp_path / "w.safetensors"))
    wrong = {n: torch.zeros(2, 2) for n in given}
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with_init = {**config, "model": {**config["model"], "init": "start.safetensors"}}
    runs_before = len(http.get(f"{API}/runs").json()["runs"])

    ok = post_run(http, with_init, (tmp_path / "w.safetensors").read_bytes())
    bad = post_run(http, with_init, (tmp_path / "wrong.safetensors").read_bytes())
    unnamed = post_run(http, config, (tmp_path / "w.safetensors").read_bytes())
    missing = post_run(http, with_init, None)

    assert ok.status_code == 201, ok.text
    run = ok.json()
    assert run["config"]["model"]["init"] == "start.safetensors"
    v0 = safetensors_load(http.get(f"{API}/runs/{run['id']}/checkpoints/0").content)
    assert all(torch.equal(v0[n], given[n]) for n in given)
    assert bad.status_code == 422 and "has shape (2, 2)" in bad.text
    assert unnamed.status_code == 422 and "needs model.init" in unnamed.text
    assert missing.status_code == 422 and "send them as a multipart file part" in missing.text
    assert len(http.get(f"{API}/runs").json()["runs"]) == runs_before + 1  # no trace of the rest


def test_the_cli_starts_a_dataset_run_from_a_hugging_face_directory(server, http, tmp_path):
    make_dataset(tmp_path / "ds")
    start = weights(LLAMA, 11)
    write_hf_dir(tmp_path / "hf", LLAMA, start, tokenizer_json=None, eod_id=256)
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\narch = "llama"\nn_layer = 1\nn_head = 2\nn_kv_head = 1\nn_embd = 32\n'
        'block_size = 32\ninit = "hf"\n[data]\ndataset = "ds"\n[inner]\nsteps = 2\n'
        "batch_size = 4\n"
    )
    config.write_text('name = "continued"\n' + config.read_text())

    out = subprocess.run(
        [sys.executable, "-m", "client.cli", "run", "create", str(config), "--server",
         server.url, "--admin-token", ADMIN_TOKEN, "--json"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip

    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)
    assert run["config"]["model"]["init"] == "hf"
    v0 = safetensors_load(http.get(f"{API}/runs/{run['id']}/checkpoints/0").content)
    assert set(v0) == set(parameter_shapes(LLAMA))
    assert all(torch.equal(v0[n], start[n]) for n in start)
