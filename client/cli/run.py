"""``diloco run ...``: create and manage runs on a server (writes need the admin token, or
a run owner's token for its own runs).

Exit codes are those of ``client.cli.support.ExitStatus``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import tomllib
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from client.api import ServerAPI
from client.cli.support import ExitStatus, fail, run_api
from diloco.config import ConfigError, RunConfig, load_config

run_app = typer.Typer(
    help="Create and manage training runs on a server (writes need the admin token, or a "
    "run owner's for its own runs).",
    no_args_is_help=True,
)

Server = Annotated[
    str,
    typer.Option(
        "--server", help="Server URL, e.g. http://localhost:8000.", envvar="DILOCO_SERVER"
    ),
]
AdminToken = Annotated[
    str | None,
    typer.Option(
        "--token",
        "--admin-token",
        help="The admin token (printed by `diloco serve` on first start), or a run owner's "
        "token (its contributor token, once the admin made it a run owner).",
        envvar=["DILOCO_TOKEN", "DILOCO_ADMIN_TOKEN"],
    ),
]
AsJson = Annotated[
    bool, typer.Option("--json", help="Print the server's JSON.", envvar="DILOCO_JSON")
]
RunId = Annotated[str, typer.Argument(help="The run's id (run_…).", envvar="DILOCO_RUN")]


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


def _num(value: Any, fmt: str = ".4f") -> str:
    return "-" if value is None else format(value, fmt)


def _round_line(cur: dict[str, Any] | None) -> str:
    if not cur:
        return "none"
    target = f", target {cur['target']}" if cur.get("target") else ""
    line = (
        f"{cur.get('index')} {cur.get('state')}  accepted {cur.get('accepted')}/"
        f"{cur.get('quorum')}{target}  deadline {cur.get('deadline')}"
    )
    return f"{line}\n{'':20}{cur['reason']}" if cur.get("reason") else line


def _owner(run: dict[str, Any]) -> str:
    owner = run.get("owner")
    return "the hub's admin" if not owner else f"{owner.get('name')} ({owner.get('id')})"


def show_run(run: dict[str, Any]) -> None:
    """Key lines of a run for a person."""
    latest, data = run.get("latest") or {}, run.get("data") or {}
    rows = [
        ("run", f"{run.get('id')}  {run.get('name')}"),
        ("owner", _owner(run)),
        ("status", str(run.get("status"))),
        ("checkpoint version", str(run.get("checkpoint_version"))),
        (
            "data",
            f"{data.get('dataset_id') or 'text file'}: {data.get('train_tokens', 0):,} tokens, "
            f"{data.get('tokens_trained', 0):,} trained ({data.get('epochs', 0.0):.2f} epochs)",
        ),
        ("current round", _round_line(run.get("current_round"))),
        (
            "latest eval loss",
            f"{_num(latest.get('eval_loss'))} (round {latest.get('round')}, "
            f"train {_num(latest.get('train_loss'))})"
            if latest
            else "-",
        ),
    ]
    for key, value in rows:
        typer.echo(f"{key:<20}{value}")


def _table(columns: list[str], rows: list[list[str]]) -> None:
    table = Table(*columns, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:  # piped: wide lines for grep rather than wrapped cells
        console = Console(width=200)
    console.print(table)


@run_app.command("create")
def create(
    config: Annotated[Path, typer.Argument(help="Run config (TOML).", envvar="DILOCO_CONFIG")],
    server: Server,
    admin_token: AdminToken = None,
    as_json: AsJson = False,
) -> None:
    """Create a run from a TOML config; the data file or prepared dataset it names is
    uploaded with it (a dataset: only the files the server lacks, resumable)."""
    from client.dataset_upload import upload_dataset  # numpy: only where a run is created
    from diloco.data.manifest import ManifestError, read_manifest

    try:
        cfg = load_config(config)  # fail fast, naming the key, before anything is sent
    except ConfigError as err:
        fail(str(err), ExitStatus.USAGE)
    raw = tomllib.loads(config.read_text(encoding="utf-8"))
    data_path: Path | None = None
    dataset: Path | None = None
    if cfg.data.path is not None:
        data_path = Path(cfg.data.path)
        if not data_path.is_file():
            fail(f"data file {data_path} (data.path in {config}) does not exist", ExitStatus.DATA)
        raw["data"]["path"] = data_path.name  # the server keeps the original file name
    elif cfg.data.dataset is not None and not cfg.data.dataset.startswith("ds_"):
        dataset = Path(cfg.data.dataset)
        try:
            read_manifest(dataset)
        except ManifestError as err:
            fail(f"data.dataset: {err}", ExitStatus.DATA)

    init = None
    if cfg.model.init is not None:  # checked here against the run's shapes, sent as ours
        init = _starting_weights(cfg, dataset, Path(tempfile.mkdtemp(prefix="diloco-init-")))
        raw["model"]["init"] = Path(cfg.model.init).name

    async def call(api: ServerAPI) -> dict[str, Any]:
        if dataset is not None:
            raw["data"]["dataset"] = await upload_dataset(api, dataset, quiet=as_json)
        return await api.create_run(raw, data_path, init)

    try:
        run = run_api(server, admin_token, call)
    finally:
        if init is not None:
            shutil.rmtree(init.parent, ignore_errors=True)
    if as_json:
        _print_json(run)
    else:
        typer.echo(run["id"])


def _starting_weights(cfg: RunConfig, dataset: Path | None, scratch: Path) -> Path:
    """``model.init`` (our safetensors or a Hugging Face directory) checked against the
    run's model and written as our fp32 safetensors for the upload."""
    from safetensors.torch import save_file

    from diloco.data.manifest import read_manifest
    from diloco.model.hf import HFError, load_initial

    assert cfg.model.init is not None
    section = cfg.model
    if dataset is not None and section.vocab_size is None:
        vocab = read_manifest(dataset).tokenizer.vocab_size
        section = section.model_copy(update={"vocab_size": vocab})
    try:
        params = load_initial(Path(cfg.model.init), section)
    except HFError as err:
        fail(str(err), ExitStatus.DATA)
    out = scratch / Path(cfg.model.init).name  # the name the server records
    save_file(params, str(out))
    return out


@run_app.command("list")
def list_runs(
    server: Server,
    admin_token: AdminToken = None,
    as_json: AsJson = False,
    owner: Annotated[
        str | None, typer.Option("--owner", help="Only the runs this account (ctr_…) owns.")
    ] = None,
) -> None:
    """List the runs, newest first."""
    runs = run_api(server, admin_token, lambda api: api.list_runs(owner))
    if as_json:
        _print_json(runs)
        return
    rows = []
    for r in runs:
        cur, latest = r.get("current_round") or {}, r.get("latest") or {}
        rnd = f"{cur.get('index')} {cur.get('state')}" if cur else "-"
        acc = f"{cur.get('accepted')}/{cur.get('quorum')}" if cur else "-"
        rows.append(
            [
                str(r.get("id")),
                str(r.get("name")),
                str((r.get("owner") or {}).get("name", "admin")),
                str(r.get("status")),
                str(r.get("checkpoint_version")),
                rnd,
                acc,
                _num(latest.get("eval_loss")),
                str(r.get("created_at", ""))[:16].replace("T", " "),
            ]
        )
    _table(
        ["ID", "NAME", "OWNER", "STATUS", "VERSION", "ROUND", "ACCEPTED", "EVAL", "CREATED"], rows
    )


@run_app.command("show")
def show(
    run_id: RunId, server: Server, admin_token: AdminToken = None, as_json: AsJson = False
) -> None:
    """Show a run: status, checkpoint version, current round, latest eval loss."""
    _print_run(run_api(server, admin_token, lambda api: api.get_run(run_id)), as_json)


def _print_run(run: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _print_json(run)
    else:
        show_run(run)


def _action(action: str, run_id: str, server: str, admin_token: str | None, as_json: bool) -> None:
    _print_run(run_api(server, admin_token, lambda api: api.run_action(run_id, action)), as_json)


@run_app.command("pause")
def pause(
    run_id: RunId, server: Server, admin_token: AdminToken = None, as_json: AsJson = False
) -> None:
    """Pause a run: no new leases, the open round waits."""
    _action("pause", run_id, server, admin_token, as_json)


@run_app.command("resume")
def resume(
    run_id: RunId, server: Server, admin_token: AdminToken = None, as_json: AsJson = False
) -> None:
    """Resume a paused run; its open round gets a fresh deadline."""
    _action("resume", run_id, server, admin_token, as_json)


@run_app.command("cancel")
def cancel(
    run_id: RunId, server: Server, admin_token: AdminToken = None, as_json: AsJson = False
) -> None:
    """Cancel a run (final)."""
    _action("cancel", run_id, server, admin_token, as_json)


@run_app.command("invite")
def invite(run_id: RunId, server: Server, admin_token: AdminToken = None) -> None:
    """Make a run private with a new invite code and print it (an older code stops
    admitting); volunteers then join with `diloco join --invite CODE`."""
    code = run_api(server, admin_token, lambda api: api.new_invite(run_id))
    typer.echo(code)


@run_app.command("ban")
def ban(
    run_id: RunId,
    contributor: Annotated[str, typer.Argument(help="The contributor's id (ctr_…).")],
    server: Server,
    reason: Annotated[
        str | None, typer.Option("--reason", help="Told to it on every refusal (to ban).")
    ] = None,
    admin_token: AdminToken = None,
    lift: Annotated[bool, typer.Option("--lift", help="Lift the ban instead.")] = False,
) -> None:
    """Ban a contributor from one run (its joins and uploads there are refused; its work
    in rounds not yet closed is left out), or lift that ban with --lift."""
    if lift:
        run_api(server, admin_token, lambda api: api.lift_run_ban(run_id, contributor))
        typer.echo(f"{contributor} may join {run_id} again")
        return
    if reason is None:
        fail("--reason: a ban needs a reason (the contributor is told it)", ExitStatus.USAGE)
    done = run_api(server, admin_token, lambda api: api.ban_from_run(run_id, contributor, reason))
    typer.echo(
        f"{contributor} banned from {run_id}: {done.get('excluded')} contributions left out, "
        f"{done.get('released')} leases released"
    )


@run_app.command("bans")
def bans(run_id: RunId, server: Server, admin_token: AdminToken = None) -> None:
    """Who is banned from a run, newest first, with the reasons."""
    items = run_api(server, admin_token, lambda api: api.run_bans(run_id))
    rows = [
        [str(b.get("contributor_id")), str(b.get("contributor_name")), str(b.get("banned_by")),
         str(b.get("banned_at", ""))[:16].replace("T", " "), str(b.get("reason"))]
        for b in items
    ]  # fmt: skip
    _table(["CONTRIBUTOR", "NAME", "BY", "SINCE", "REASON"], rows)


@run_app.command("rounds")
def rounds(
    run_id: RunId, server: Server, admin_token: AdminToken = None, as_json: AsJson = False
) -> None:
    """List a run's rounds, oldest first, with their losses and why each closed."""
    items = run_api(server, admin_token, lambda api: api.list_rounds(run_id))
    if as_json:
        _print_json(items)
        return
    rows = [
        [
            str(r.get("index")),
            str(r.get("state")),
            str(r.get("accepted")),
            f"{r.get('tokens') or 0:,}",
            _num(r.get("train_loss")),
            _num(r.get("eval_loss")),
            _num(r.get("update_norm")),
            str(r.get("close_reason") or ""),
        ]
        for r in items
    ]
    _table(["ROUND", "STATE", "ACCEPTED", "TOKENS", "TRAIN", "EVAL", "UPDATE", "REASON"], rows)
