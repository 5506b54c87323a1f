"""The volunteer's files: where ``DILOCO_HOME`` puts them, and ``client.toml``."""

from __future__ import annotations

import tomllib

import pytest

from client import credentials
from client.config_file import (
    CLIENT_CONFIG_FILE,
    ClientConfig,
    ClientConfigError,
    load_client_config,
    save_client_config,
    toml_string,
)

# ---------------------------------------------------------------- DILOCO_HOME


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("DILOCO_HOME", "DILOCO_CONFIG_DIR", "DILOCO_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return monkeypatch


def test_diloco_home_holds_the_config_and_cache_dirs(clean_env, tmp_path):
    clean_env.setenv("DILOCO_HOME", str(tmp_path / "home"))

    assert credentials.config_dir() == tmp_path / "home" / "config"
    assert credentials.cache_dir() == tmp_path / "home" / "cache"


def test_the_specific_dir_variables_win_over_diloco_home(clean_env, tmp_path):
    clean_env.setenv("DILOCO_HOME", str(tmp_path / "home"))
    clean_env.setenv("DILOCO_CONFIG_DIR", str(tmp_path / "cfg"))
    clean_env.setenv("DILOCO_CACHE_DIR", str(tmp_path / "cache"))

    assert credentials.config_dir() == tmp_path / "cfg"
    assert credentials.cache_dir() == tmp_path / "cache"


def test_without_diloco_home_the_xdg_dirs_are_used(clean_env, tmp_path):
    assert credentials.config_dir() == tmp_path / "xdg-config" / "diloco"
    assert credentials.cache_dir() == tmp_path / "xdg-cache" / "diloco"


def test_diloco_home_does_not_move_the_server_data_dir(clean_env, tmp_path):
    clean_env.setenv("DILOCO_HOME", str(tmp_path / "home"))
    clean_env.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))

    assert credentials.default_data_dir() == tmp_path / "xdg-data" / "diloco"


# ---------------------------------------------------------------- client.toml


def test_a_missing_config_file_is_an_empty_config(tmp_path):
    assert load_client_config(tmp_path) == ClientConfig()


def test_a_saved_config_reads_back_with_the_server_url_normalised(tmp_path):
    cfg = ClientConfig(server="HTTP://Hub.Example.org:80/", name="alice", device="cuda")

    path = save_client_config(cfg, tmp_path / "new")

    assert path == tmp_path / "new" / CLIENT_CONFIG_FILE
    assert load_client_config(tmp_path / "new") == ClientConfig(
        server="http://hub.example.org", name="alice", device="cuda"
    )
    assert "run" not in tomllib.loads(path.read_text())  # None is left out
    assert [p.name for p in (tmp_path / "new").iterdir()] == [CLIENT_CONFIG_FILE]  # no temp


def test_saving_replaces_the_whole_file(tmp_path):
    save_client_config(ClientConfig(server="http://a", run="run_1"), tmp_path)
    save_client_config(ClientConfig(server="http://b"), tmp_path)

    assert load_client_config(tmp_path) == ClientConfig(server="http://b")


@pytest.mark.parametrize(
    "value",
    ['al"ice', "back\\slash", "tab\tand\nnewline", "ünïcødé ☃ 名前", "ctl\x01\x7f", "'single'", ""],
)
def test_toml_strings_round_trip_through_tomllib(value):
    assert tomllib.loads(f"k = {toml_string(value)}")["k"] == value


def test_names_with_quotes_backslashes_and_unicode_survive_a_save(tmp_path):
    name = 'Ann "the \\ builder" Ö 🚀'

    save_client_config(ClientConfig(name=name), tmp_path)

    assert load_client_config(tmp_path).name == name


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("server = ", r"client\.toml is not valid TOML"),
        ('servr = "http://a"', r"client\.toml: unknown key 'servr'"),
        ("name = 3", r"client\.toml: name must be a string"),
        ('device = "gpu"', r"client\.toml: device must be one of auto, cpu, cuda, mps"),
        ('server = "ftp://a"', r"client\.toml: server: .*scheme"),
        ('run = ""', r"client\.toml: run must not be empty"),
        ("[server]\nurl = 'x'", r"client\.toml: server must be a string"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_file_and_key(tmp_path, text, match):
    (tmp_path / CLIENT_CONFIG_FILE).write_text(text)

    with pytest.raises(ClientConfigError, match=match):
        load_client_config(tmp_path)


def test_a_config_with_a_bad_value_is_not_saved(tmp_path):
    with pytest.raises(ClientConfigError, match="device"):
        save_client_config(ClientConfig(device="tpu"), tmp_path)
    assert not (tmp_path / CLIENT_CONFIG_FILE).exists()


def test_the_default_directory_is_the_config_dir(clean_env, tmp_path):
    clean_env.setenv("DILOCO_HOME", str(tmp_path / "home"))

    path = save_client_config(ClientConfig(server="localhost:8000"))

    assert path == tmp_path / "home" / "config" / CLIENT_CONFIG_FILE
    assert load_client_config().server == "http://localhost:8000"
