"""``diloco run create`` with ``data.dataset = "DIR"``: send a prepared dataset to the server.

The manifest goes first; the server answers which of its files it lacks, and only those are
sent, one by one, streamed, each with its own progress bar. The server keeps a file only
when its size and sha256 are the manifest's, so an upload cut anywhere is resumed by
running the same command again: finished files are not sent twice, and the file that was
cut starts over (files are a shard each: 32 MiB by default).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import Progress, TaskID

from client.api import ServerAPI
from client.cli.data import byte_columns
from diloco.data.manifest import MANIFEST, read_manifest


async def upload_dataset(api: ServerAPI, folder: Path, *, quiet: bool = False) -> str:
    """The dataset's id on the server, once every file is there."""
    manifest = read_manifest(folder)  # validated here first: a bad folder fails before sending
    state = await api.register_dataset((folder / MANIFEST).read_bytes())
    missing: list[str] = list(state["missing"])
    console = Console(stderr=True)
    show = not quiet and console.is_terminal
    sizes = manifest.files()
    for name in missing:
        path = folder / name
        if not path.is_file() or path.stat().st_size != sizes[name][0]:
            raise FileNotFoundError(
                f"{path}: missing or not the size the manifest says; run `diloco data verify "
                f"{folder}`"
            )
    with Progress(*byte_columns(), console=console, disable=not show) as bar:
        for name in missing:
            task = bar.add_task(name, total=sizes[name][0])

            def advance(n: int, task: TaskID = task) -> None:
                bar.advance(task, n)

            await api.upload_dataset_file(state["id"], name, folder / name, advance)
    if missing:
        state = await api.dataset(state["id"])
        if not state["complete"]:
            raise RuntimeError(f"the server still lacks {', '.join(state['missing'])}")
    if not quiet:
        sent = sum(sizes[n][0] for n in missing)
        console.print(
            f"dataset {state['id']}: {len(missing)} file(s) sent ({sent / 1e6:,.1f} MB), "
            f"{len(sizes) - len(missing)} already on the server",
            soft_wrap=True,
        )
    return str(state["id"])
