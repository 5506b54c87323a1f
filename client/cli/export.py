"""``diloco run export``: a run's checkpoint as a Hugging Face model directory.

The directory (``config.json``, ``model.safetensors``, the tokenizer's files) loads with
``transformers.AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``,
and with ``diloco sample``. The checkpoint is downloaded verified against its sha256 (the
server's ETag); the tokenizer is the run's dataset's own ``tokenizer.json``, byte for byte,
or for a text-file run the byte-level tokenizer its vocabulary of 256 is.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from client.api import ServerAPI
from client.cli.run import AdminToken, RunId, Server
from client.cli.support import ExitStatus, fail, run_api
from diloco.config import ConfigError, RunConfig, parse_config

Version = Annotated[
    str,
    typer.Option("--version", help="Checkpoint version, or `latest`.", envvar="DILOCO_VERSION"),
]


def export(
    run_id: RunId,
    server: Server,
    out: Annotated[
        Path, typer.Option("--out", help="The directory to write (created).", envvar="DILOCO_OUT")
    ],
    version: Version = "latest",
    admin_token: AdminToken = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace files in a non-empty --out.")
    ] = False,
) -> None:
    """Write a run's checkpoint as a Hugging Face model directory."""
    if version != "latest" and not version.isdigit():
        fail(f"--version must be a number or `latest`, not {version!r}", ExitStatus.USAGE)
    if out.exists() and any(out.iterdir()) and not force:
        fail(f"{out} is not empty; pass --force to replace its files", ExitStatus.USAGE)

    async def call(api: ServerAPI) -> tuple[dict[str, Any], int, Path, str | None, int | None]:
        run = await api.get_run(run_id)
        number, sha = await api.checkpoint_etag(run_id, version)
        scratch = Path(tempfile.mkdtemp(prefix="diloco-export-"))
        params = scratch / "params.safetensors"
        await api.download(f"/runs/{run_id}/checkpoints/{number}", params, sha)
        tokenizer, eod = await _tokenizer(api, run["config"], scratch)
        return run, number, params, tokenizer, eod

    run, number, params_path, tokenizer_json, eod_id = run_api(server, admin_token, call)
    try:
        cfg = parse_config(run["config"])
    except ConfigError as err:
        fail(
            f"the run's config does not validate here ({err}); upgrade the client", ExitStatus.ERROR
        )
    _write(cfg, params_path, out, tokenizer_json, eod_id)
    typer.echo(f"exported {run_id} version {number} ({cfg.model.arch}) to {out}")


async def _tokenizer(
    api: ServerAPI, config: dict[str, Any], scratch: Path
) -> tuple[str | None, int | None]:
    """The run's tokenizer.json text and end-of-document id: the dataset's own, or None for
    a text-file run (the byte-level tokenizer is built locally)."""
    dataset = (config.get("data") or {}).get("dataset")
    if dataset is None:
        return None, None
    info = await api.dataset(dataset)
    entry = info["manifest"]["tokenizer"]
    path = scratch / "tokenizer.json"
    await api.download(f"/datasets/{dataset}/files/tokenizer.json", path, entry["sha256"])
    return path.read_text(encoding="utf-8"), int(entry["eod_id"])


def _write(
    cfg: RunConfig, params_path: Path, out: Path, tokenizer_json: str | None, eod_id: int | None
) -> None:
    from diloco.checkpoint import checkpoint_params_only
    from diloco.data.tokenizer import byte_tokenizer
    from diloco.model.hf import write_hf_dir

    if tokenizer_json is None:  # a text-file run: ids are bytes, no end-of-document token
        tokenizer_json = byte_tokenizer(eod=False).to_json()
    params = {n: t.float() for n, t in checkpoint_params_only(params_path).items()}
    out.mkdir(parents=True, exist_ok=True)
    write_hf_dir(out, cfg.model, params, tokenizer_json=tokenizer_json, eod_id=eod_id)
    params_path.unlink(missing_ok=True)
