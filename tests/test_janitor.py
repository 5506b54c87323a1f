"""The janitor's decision, ``plan``: a pure function of (now, what is on disk, what the
database knows). A fixed ``now``; ages in seconds; the grace age is one hour."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

from server.storage.base import BlobInfo
from server.upkeep.janitor import Removal, Scan, plan

NOW = 1_000_000.0
HOUR = 3600.0
OLD = NOW - 2 * HOUR  # past the grace age
YOUNG = NOW - 60  # within it: may be work in progress


def blob(key: str, modified: float) -> BlobInfo:
    return BlobInfo(key=key, nbytes=1, modified=modified)


def decide(
    *,
    blobs: Sequence[BlobInfo] = (),
    unfinished: Sequence[BlobInfo] = (),
    tmp_files: Sequence[tuple[Path, float]] = (),
    known_runs: Collection[str] = (),
    referenced: Collection[str] = (),
) -> tuple[dict[str, str], list[str]]:
    """{target: kind} of the removals, and the reasons folders were kept."""
    scan = Scan(blobs=list(blobs), unfinished=list(unfinished), tmp_files=list(tmp_files))
    result = plan(
        now=NOW, max_age=HOUR, scan=scan, known_runs=set(known_runs), referenced=set(referenced)
    )
    targets = [r.target for r in result.removals]
    assert len(targets) == len(set(targets)), "nothing is removed twice"
    return {r.target: r.kind for r in result.removals}, result.kept


def test_unfinished_writes_are_removed_once_old_and_kept_while_young():
    removed, _ = decide(
        unfinished=[
            blob("runs/r1/checkpoints/.3.safetensors.tmp-0a1b2c3d4e5f", OLD),
            blob("runs/r1/rounds/3/.c1-ab.bin.tmp-0a1b2c3d4e5f", YOUNG),
        ],
        known_runs={"r1"},
    )

    assert removed == {"runs/r1/checkpoints/.3.safetensors.tmp-0a1b2c3d4e5f": "temp_file"}


def test_an_old_round_blob_without_a_row_is_an_orphan_and_one_with_a_row_is_kept():
    removed, _ = decide(
        blobs=[
            blob("runs/r1/rounds/2/c1-aa.bin", OLD),  # its row committed
            blob("runs/r1/rounds/2/c2-bb.bin", OLD),  # the server died before the row
            blob("runs/r1/rounds/3/c3-cc.bin", YOUNG),  # the row may be on its way
        ],
        known_runs={"r1"},
        referenced={"runs/r1/rounds/2/c1-aa.bin"},
    )

    assert removed == {"runs/r1/rounds/2/c2-bb.bin": "orphan_blob"}


def test_a_runs_data_and_checkpoints_are_never_orphans_however_old():
    removed, kept = decide(
        blobs=[
            blob("runs/r1/data/val.bin", OLD),
            blob("runs/r1/data/shard-0.bin", OLD),
            blob("runs/r1/checkpoints/0.safetensors", OLD),
            blob("runs/r1/checkpoints/7.state.safetensors", OLD),
        ],
        known_runs={"r1"},
    )

    assert removed == {} and kept == []


def test_an_old_folder_without_a_run_row_goes_whole_with_its_temp_files():
    removed, _ = decide(
        blobs=[blob("runs/gone/data/val.bin", OLD), blob("runs/gone/data/shard-0.bin", OLD)],
        unfinished=[blob("runs/gone/checkpoints/.0.safetensors.tmp-0a1b2c3d4e5f", OLD)],
    )

    assert removed == {"runs/gone/": "orphan_run"}


def test_a_folder_without_a_row_is_kept_while_any_of_its_files_is_young():
    removed, _ = decide(
        blobs=[blob("runs/new/data/val.bin", OLD), blob("runs/new/data/shard-0.bin", YOUNG)]
    )

    assert removed == {}


def test_a_folder_with_trained_checkpoints_but_no_row_is_kept_with_a_warning():
    removed, kept = decide(
        blobs=[
            blob("runs/r9/data/val.bin", OLD),
            blob("runs/r9/checkpoints/0.safetensors", OLD),
            blob("runs/r9/checkpoints/12.safetensors", OLD),
        ]
    )

    assert removed == {}
    assert len(kept) == 1 and "runs/r9/" in kept[0] and "checkpoints/12.safetensors" in kept[0]


def test_files_in_the_tmp_folder_are_removed_once_old():
    old, young = Path("/data/tmp/tmp1.txt"), Path("/data/tmp/tmp2.txt")

    removed, _ = decide(tmp_files=[(old, OLD), (young, YOUNG)])

    assert removed == {str(old): "temp_file"}


def test_a_removal_says_why_and_how_old():
    scan = Scan(blobs=[blob("runs/gone/data/val.bin", OLD)], unfinished=[], tmp_files=[])

    (removal,) = plan(now=NOW, max_age=HOUR, scan=scan, known_runs=set(), referenced=set()).removals

    assert removal == Removal(
        "orphan_run",
        "runs/gone/",
        "no run gone in the database, last written 2.0 h ago (a run creation that failed or "
        "crashed)",
    )


def test_a_direct_upload_never_committed_is_removed_once_old():
    removed, _ = decide(
        blobs=[
            blob("runs/r1/incoming/2/c1.bin", OLD),  # PUT, then the volunteer vanished
            blob("runs/r1/incoming/3/c2.bin", YOUNG),  # its commit may be on its way
        ],
        known_runs={"r1"},
    )

    assert removed == {"runs/r1/incoming/2/c1.bin": "stale_upload"}
