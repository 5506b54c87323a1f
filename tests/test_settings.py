"""The hub's settings hold operator limits only: a variable that once changed how a run
behaves (now its run config's) is refused at start, never silently ignored."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.settings import RETIRED, Settings


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_a_retired_variable_stops_the_server_naming_where_it_went(monkeypatch, name):
    monkeypatch.setenv(f"DILOCO_{name}", "5")

    with pytest.raises(ValidationError, match=rf"DILOCO_{name} is no longer a server setting"):
        Settings()


def test_without_them_the_limits_have_defaults_every_valid_config_fits(monkeypatch):
    for name in RETIRED:
        monkeypatch.delenv(f"DILOCO_{name}", raising=False)

    settings = Settings()

    assert (settings.min_heartbeat_interval_s, settings.max_eval_windows) == (1.0, 1024)
