"""``diloco data prepare|verify``: a corpus becomes a prepared dataset (``diloco.data.prepare``).

Exit codes are those of ``client.cli.support.ExitStatus``: 2 for a bad option, 3 for bad
data (an input, a tokenizer or a dataset that does not check out).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from client.cli.support import ExitStatus, fail

data_app = typer.Typer(
    help="Prepare tokenized datasets for runs (a run config's data.dataset).", no_args_is_help=True
)
Report = Callable[[str, int], None]  # (stage, bytes done)
Quiet = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress bar.", envvar="DILOCO_QUIET")
]


def byte_columns() -> tuple[ProgressColumn, ...]:
    """A bar's columns for a transfer: what, bar, bytes, speed, time left."""
    return (
        TextColumn("{task.description:<20}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )


@contextlib.contextmanager
def byte_progress(total: int, *, quiet: bool) -> Iterator[Report]:
    """A rich bar over input bytes, one task per stage; off with --quiet or off a TTY."""
    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        yield lambda stage, n: None
        return
    tasks: dict[str, TaskID] = {}
    with Progress(*byte_columns(), console=console, transient=False) as bar:

        def advance(stage: str, n: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.advance(tasks[stage], n)

        yield advance


@data_app.command("prepare")
def prepare(
    inputs: Annotated[
        list[Path], typer.Argument(help=".txt, .jsonl (a `text` field) or .parquet (`text`).")
    ],
    out: Annotated[Path, typer.Option("--out", help="The dataset folder.", envvar="DILOCO_OUT")],
    tokenizer: Annotated[
        str,
        typer.Option(
            "--tokenizer",
            help="bytes, train:VOCAB (a byte-level BPE trained on the inputs) or a tokenizer.json.",
            envvar="DILOCO_TOKENIZER",
        ),
    ] = "bytes",
    eod_token: Annotated[
        str | None,
        typer.Option("--eod-token", help="A given tokenizer's end-of-document token."),
    ] = None,
    shard_tokens: Annotated[
        int, typer.Option("--shard-tokens", help="Tokens per training shard.", min=2)
    ] = 1 << 24,
    val_every: Annotated[
        int, typer.Option("--val-every", help="Every N-th block of the stream is held out.", min=1)
    ] = 100,
    val_block: Annotated[
        int, typer.Option("--val-block", help="Tokens per held-out block.", min=2)
    ] = 8192,
    val_tokens: Annotated[
        int, typer.Option("--val-tokens", help="At most this many validation tokens.", min=2)
    ] = 1 << 22,
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty --out.")] = False,
    quiet: Quiet = False,
) -> None:
    """Tokenize a corpus into training shards, a validation file and a manifest."""
    from diloco.data.inputs import InputError
    from diloco.data.manifest import dataset_id
    from diloco.data.prepare import PrepareError, PrepareOptions
    from diloco.data.prepare import prepare as run_prepare
    from diloco.data.tokenizer import TokenizerError

    opts = PrepareOptions(
        tokenizer=tokenizer,
        eod_token=eod_token,
        shard_tokens=shard_tokens,
        val_block=val_block,
        val_every=val_every,
        val_tokens=val_tokens,
        force=force,
    )
    total = sum(p.stat().st_size for p in inputs if p.is_file())
    try:
        with byte_progress(total, quiet=quiet) as report:
            summary = run_prepare(inputs, out, opts, report)
    except (InputError, TokenizerError) as err:
        fail(str(err), ExitStatus.DATA)
    except PrepareError as err:
        fail(str(err), ExitStatus.USAGE if "--" in str(err) else ExitStatus.DATA)
    m = summary.manifest
    print(
        f"{m.documents:,} documents, {m.train_tokens:,} training tokens in {len(m.shards)} "
        f"shard(s), {m.val.tokens:,} validation tokens; vocabulary {m.tokenizer.vocab_size:,} "
        f"({m.tokenizer.kind}, end of document = {m.tokenizer.eod_id}), {m.dtype}",
        file=sys.stderr,
    )
    typer.echo(f"{dataset_id(m)}  {out}")


@data_app.command("verify")
def verify(
    folder: Annotated[Path, typer.Argument(help="A prepared dataset folder.")],
    quiet: Quiet = False,
) -> None:
    """Check every file of a prepared dataset against its manifest (size, sha256)."""
    from diloco.data.manifest import ManifestError, dataset_id
    from diloco.data.prepare import verify as run_verify

    total = sum(p.stat().st_size for p in folder.glob("*") if p.is_file())
    try:
        with byte_progress(total, quiet=quiet) as report:
            manifest = run_verify(folder, report)
    except ManifestError as err:
        fail(str(err), ExitStatus.DATA)
    typer.echo(f"{dataset_id(manifest)}  {folder}: every file matches its manifest")
