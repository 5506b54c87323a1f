"""The object key layout (``server.storage.keys``): every key a run writes reads back as its run
and its kind, which is what the janitor, retention and ``GET /runs/{id}/storage`` rely on."""

from __future__ import annotations

import pytest

from server.storage import keys

RUN = "run_0123456789ab"
V3 = keys.version(RUN, 3)


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        (keys.val(RUN), "data"),
        (keys.shard(RUN, 7), "data"),
        (V3.params, "checkpoints"),
        (V3.state, "states"),
        (V3.delta, "deltas"),
        (keys.contribution(RUN, 4, "ctr_1"), "contributions"),
        (keys.incoming(RUN, 4, "ctr_1"), "incoming"),
    ],
    # fixed ids: a contribution's key has a random part, and xdist's workers must collect
    # the same test ids
    ids=["val", "shard", "params", "state", "delta", "contribution", "incoming"],
)
def test_every_key_of_a_run_reads_back_as_its_run_and_kind(key, kind):
    assert key.startswith(keys.run(RUN)) and keys.run_of(key) == RUN
    assert keys.kind_of(key.removeprefix(keys.run(RUN))) == kind
    assert keys.is_contribution(key) == (kind == "contributions")
    assert keys.is_data(key) == (kind == "data")


def test_a_datasets_files_are_data_and_a_runs_other_keys_are_not():
    assert keys.is_data(keys.training_shard(RUN, "ds_1", 3))
    assert keys.is_data(keys.validation(RUN, "ds_1"))
    assert not keys.is_data(keys.audit_state(RUN, "aud_1"))
    assert not keys.is_data(keys.version(RUN, 3).params)


def test_a_contributions_key_is_fresh_each_time_so_a_retry_never_overwrites_a_stored_blob():
    first, second = (keys.contribution(RUN, 4, "ctr_1") for _ in range(2))

    assert first != second
    assert first.startswith(f"{keys.rounds(RUN)}4/ctr_1-")


def test_only_data_and_version_zero_are_written_at_a_runs_creation():
    zero = keys.version(RUN, 0)

    assert [keys.written_at_creation(k) for k in (keys.val(RUN), zero.params, zero.state)] == [
        True,
        True,
        True,
    ]
    assert not keys.written_at_creation(V3.params)
    assert not keys.written_at_creation(keys.contribution(RUN, 1, "ctr_1"))
    assert keys.run_of(keys.dataset_file("ds_1", "val.bin")) is None


def test_a_runs_shards_are_its_own_or_its_datasets():
    assert keys.training_shard(RUN, None, 2) == keys.shard(RUN, 2)
    assert keys.training_shard(RUN, "ds_1", 2) == "datasets/ds_1/shard-00002.bin"
    assert keys.validation(RUN, "ds_1") == "datasets/ds_1/val.bin"
