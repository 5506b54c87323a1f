from pathlib import Path

import pytest

from diloco.config import ConfigError, load_config, parse_config
from diloco.outer.memory import close_memory_bytes

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "shakespeare-tiny.toml"


def minimal(**extra):
    return {"name": "x", "data": {"path": "input.txt"}, **extra}


def test_example_config_loads_and_resolves_the_data_path_against_its_folder():
    cfg = load_config(EXAMPLE)

    assert cfg.inner.steps == 10
    assert Path(cfg.data.path).is_absolute()
    assert Path(cfg.data.path).exists()


def test_defaults_follow_the_spec():
    cfg = parse_config(minimal())

    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == (0.7, 0.9, True)
    assert cfg.compression.kind == "int8" and cfg.compression.block_size == 4096
    assert cfg.rounds.target is None


def test_unknown_top_level_key_is_rejected_with_its_name():
    with pytest.raises(ConfigError, match=r"^colour: unknown key$"):
        parse_config(minimal(colour="blue"))


def test_unknown_nested_key_is_rejected_with_its_dotted_name():
    with pytest.raises(ConfigError, match=r"inner\.learning_rate: unknown key"):
        parse_config(minimal(inner={"learning_rate": 0.1}))


def test_bad_value_names_the_key():
    with pytest.raises(ConfigError, match=r"inner\.lr: Input should be greater than 0"):
        parse_config(minimal(inner={"lr": -1}))


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"rounds\.quorum: Input should be a valid integer"):
        parse_config(minimal(rounds={"quorum": "two"}))


def test_missing_data_section_is_named():
    with pytest.raises(ConfigError, match=r"^data: Field required$"):
        parse_config({"name": "x"})


def test_nesterov_without_momentum_is_an_invalid_combination():
    with pytest.raises(ConfigError, match=r"outer\.nesterov: Nesterov momentum needs momentum > 0"):
        parse_config(minimal(outer={"momentum": 0.0}))


def test_target_below_quorum_is_an_invalid_combination():
    with pytest.raises(ConfigError, match=r"rounds\.target: target \(1\) must be at least quorum"):
        parse_config(minimal(rounds={"quorum": 2, "target": 1}))


def test_a_runs_heartbeats_lease_ttl_extensions_and_eval_windows_are_its_configs():
    cfg = parse_config(minimal())
    tuned = parse_config(
        minimal(
            rounds={"heartbeat_interval_s": 2, "lease_ttl_s": 5, "max_extensions": 3},
            eval={"windows": 8},
        )
    )

    assert (cfg.rounds.heartbeat_interval_s, cfg.rounds.lease_ttl_s) == (10.0, 30.0)
    assert (cfg.rounds.max_extensions, cfg.eval.windows) == (None, 64)
    assert (tuned.rounds.heartbeat_interval_s, tuned.rounds.lease_ttl_s) == (2.0, 5.0)
    assert (tuned.rounds.max_extensions, tuned.eval.windows) == (3, 8)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"rounds": {"heartbeat_interval_s": 10, "lease_ttl_s": 10}},
         r"rounds\.lease_ttl_s: lease_ttl_s \(10\) must be longer than heartbeat_interval_s"),
        ({"rounds": {"heartbeat_interval_s": 0.5}}, r"rounds\.heartbeat_interval_s: .*1"),
        ({"rounds": {"max_extensions": -1}}, r"rounds\.max_extensions: .*0"),
        ({"eval": {"windows": 0}}, r"eval\.windows: .*1"),
    ],
)  # fmt: skip
def test_a_lease_that_would_lapse_between_heartbeats_or_a_bad_bound_is_refused(section, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(minimal(**section))


def test_heads_must_divide_width():
    with pytest.raises(ConfigError, match=r"model\.n_head: n_embd \(100\) must be a multiple"):
        parse_config(minimal(model={"n_embd": 100, "n_head": 3}))


def test_unknown_compression_kind_is_named():
    with pytest.raises(
        ConfigError,
        match=r"compression\.kind: Input should be 'int8', 'none', 'int4', 'int2' or 'sparse'",
    ):
        parse_config(minimal(compression={"kind": "fp8"}))


def test_several_errors_are_all_reported():
    with pytest.raises(ConfigError) as info:
        parse_config(minimal(inner={"lr": 0, "steps": 0}))

    assert "inner.lr" in str(info.value) and "inner.steps" in str(info.value)


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("name = \n")

    with pytest.raises(ConfigError, match=r"bad\.toml: invalid TOML"):
        load_config(path)


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_a_round_deadline_under_a_second_or_over_a_week_is_refused():
    with pytest.raises(ConfigError, match=r"rounds\.timeout_s: Input should be greater than or"):
        parse_config(minimal(rounds={"timeout_s": 0.5}))
    with pytest.raises(ConfigError, match=r"rounds\.timeout_s: Input should be less than or"):
        parse_config(minimal(rounds={"timeout_s": 7 * 24 * 3600 + 1}))


def test_close_memory_is_one_model_copy_and_the_largest_tensor_plus_eval_data_and_buffers():
    cfg = parse_config(minimal(model={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16}))
    # wte 256x32, wpe 16x32, one block 12·32² + 13·32, ln_f 2·32 (the head is wte, tied)
    params = 256 * 32 + 16 * 32 + (12 * 32 * 32 + 13 * 32) + 2 * 32
    largest = 256 * 32  # wte, above the attention's qkv weight (3 x 32 x 32)
    activations = 32 * 16 * (12 * 32 + 3 * 256)  # eval batch x block_size x (12 C + 3 V)

    need = close_memory_bytes(cfg, val_bytes=1000)

    assert need == 4 * params + 2 * 4 * largest + 4 * activations + 2 * 1000 + (160 << 20)


def test_the_issues_1_2_billion_parameter_model_needs_about_five_gigabytes_to_close():
    cfg = parse_config(
        minimal(model={"n_layer": 24, "n_head": 16, "n_embd": 2048, "block_size": 128})
    )

    # 1.21e9 params x 4 bytes (4.5 GiB), the eval forward's batch and the buffers
    assert 5 << 30 < close_memory_bytes(cfg) < 5.5 * (1 << 30)


def test_the_packed_compression_kinds_and_their_keys():
    cfg = parse_config(minimal(compression={"kind": "sparse"}))
    c = cfg.compression
    assert (c.kind, c.chunk, c.topk, c.bits, c.ef_decay) == ("sparse", 4096, 64, 2, 1.0)
    assert (
        parse_config(minimal(compression={"kind": "int2", "ef_decay": 0.9})).compression.ef_decay
        == 0.9
    )


@pytest.mark.parametrize(
    ("compression", "message"),
    [
        (
            {"kind": "sparse", "chunk": 64, "topk": 65},
            "topk: 65 values cannot be kept of a chunk of 64",
        ),
        ({"kind": "sparse", "bits": 5}, r"compression\.bits: Input should be 1, 2, 3, 4 or 8"),
        (
            {"kind": "int2", "ef_decay": 1.5},
            r"compression\.ef_decay: Input should be less than or equal to 1",
        ),
        ({"kind": "int3"}, r"compression\.kind: Input should be"),
    ],
)
def test_bad_compression_settings_are_refused_naming_the_key(compression, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(minimal(compression=compression))


@pytest.mark.parametrize(
    ("outer", "expected"),
    [
        ({}, (3.0, 0.0, False)),  # SparseLoCo's plain step, at the benchmark's lr
        ({"warmup_rounds": 2}, (3.0, 0.0, False)),  # other [outer] keys do not count
        ({"lr": 1.5}, (1.5, 0.9, True)),  # one named: the others' platform defaults
        ({"nesterov": False, "momentum": 0.5}, (0.7, 0.5, False)),
    ],
)
def test_a_sparse_runs_outer_step_is_the_plain_one_unless_its_config_names_one(outer, expected):
    cfg = parse_config({"name": "t", "data": {"path": "x"}, "compression": {"kind": "sparse"},
                        "outer": outer})  # fmt: skip
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == expected
    # an int8 run keeps Nesterov's defaults
    plain = parse_config({"name": "t", "data": {"path": "x"}})
    assert (plain.outer.lr, plain.outer.momentum, plain.outer.nesterov) == (0.7, 0.9, True)


@pytest.mark.parametrize(
    ("compression", "step", "download"),
    [
        ({}, (3.0, 0.0, False), ("sparse", 512)),  # the defaults: 64 of 4096, deltas 8x
        ({"topk": 256}, (3.0, 0.0, False), ("sparse", 2048)),  # deltas keep half a chunk
        ({"topk": 1024}, (3.0, 0.0, False), ("int8", 4096)),  # a quarter: still the plain step
        ({"topk": 2048}, (0.7, 0.9, True), ("int8", 4096)),  # half: as dense uploads are
        ({"topk": 2048, "download_topk": 4096}, (0.7, 0.9, True), ("sparse", 4096)),  # named
        ({"topk": 32, "chunk": 64}, (0.7, 0.9, True), ("int8", 64)),  # the share, not the k
    ],
)
def test_a_sparse_runs_defaults_follow_how_sparse_its_uploads_are(compression, step, download):
    """The plain outer step only while uploads keep at most a quarter of each chunk, and
    int8 deltas where a sparse delta would keep more than half of it (tuning notes,
    "Sparse uploads, denser")."""
    cfg = parse_config(minimal(compression={"kind": "sparse", **compression}))

    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == step
    pinned = cfg.compression.pinned()
    assert (pinned.download, pinned.download_topk) == download


def test_overrides_are_put_over_the_file_before_defaults_are_derived(tmp_path):
    # diloco simulate --compression sparse on an int8 file: the sparse run's outer step,
    # and --outer-lr over the file's own value
    path = tmp_path / "run.toml"
    path.write_text('name = "t"\n[data]\npath = "x.txt"\n[compression]\nkind = "int8"\n')

    sparse = load_config(path, {"compression": {"kind": "sparse"}, "outer": {"lr": None}})
    chosen = load_config(path, {"outer": {"lr": 0.5}, "rounds": {}})

    assert (sparse.outer.nesterov, sparse.compression.download_kind) == (False, "sparse")
    assert (chosen.outer.lr, chosen.outer.nesterov, chosen.compression.kind) == (0.5, True, "int8")
    assert sparse.data.path == str((tmp_path / "x.txt").resolve())


@pytest.mark.parametrize(
    ("compression", "block"),
    [
        ({"kind": "int2"}, 256),  # int2 left to its default block (BLOCK_FOR)
        ({"kind": "int2", "block_size": 4096}, 4096),  # named: kept
        ({"kind": "int4"}, 4096),
        ({}, 4096),
    ],
)
def test_the_scale_block_follows_the_kind_unless_named_and_is_recorded(compression, block):
    cfg = parse_config(minimal(compression=compression))

    assert cfg.compression.block_size == block
    # what a run records at creation names it, so a later default never changes the run
    assert cfg.pinned().model_dump()["compression"]["block_size"] == block


def test_an_override_of_the_kind_gets_that_kinds_block(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('name = "t"\n[data]\npath = "x.txt"\n[compression]\nkind = "int8"\n')

    assert load_config(path, {"compression": {"kind": "int2"}}).compression.block_size == 256
    assert load_config(path).compression.block_size == 4096


@pytest.mark.parametrize("overlap", [-0.1, 0.95])
def test_overlap_is_a_share_of_h_below_one(overlap):
    with pytest.raises(ConfigError, match=r"inner\.overlap"):
        parse_config(minimal(inner={"overlap": overlap}))


@pytest.mark.parametrize(
    ("overlap", "lease_steps", "cap"),
    [(0.0, 10, 0), (0.2, 10, 2), (0.3, 10, 3), (0.9, 10, 9), (0.5, 1, 0), (0.9, 2, 1)],
)
def test_the_steps_ahead_are_a_share_of_the_last_lease_leaving_one(overlap, lease_steps, cap):
    cfg = parse_config(minimal(inner={"overlap": overlap}))

    assert cfg.inner.ahead_cap(lease_steps) == cap
