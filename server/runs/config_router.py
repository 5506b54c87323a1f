"""The run config as the dashboard's form needs it: its JSON schema (the one the server
validates with, generated from ``diloco.config.RunConfig``) and a check of a draft (TOML
or JSON) with the server's own rules, so a form can show errors as one types."""

from __future__ import annotations

import tomllib
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from diloco.config import ConfigError, RunConfig, parse_config
from diloco.model.architectures import parameter_count
from server.http.errors import InvalidConfig
from server.runs.limits import check_limits

router = APIRouter(prefix="/api/v1/config", tags=["runs"])


class ConfigDraft(BaseModel):
    """A run config to check: as TOML text (what ``diloco run create`` reads) or as JSON
    (what ``POST /runs`` takes), one of the two."""

    model_config = ConfigDict(extra="forbid")

    toml: str | None = Field(None, max_length=64 << 10)
    config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one(self) -> ConfigDraft:
        if (self.toml is None) == (self.config is None):
            raise ValueError("send either toml or config")
        return self


class ConfigChecked(BaseModel):
    config: dict[str, Any]  # as JSON, with every default filled in: what POST /runs takes
    parameters: int | None  # the model's, where its vocabulary is known (a text file: bytes)


@router.get("/schema")
async def schema() -> dict[str, Any]:
    """The run config's JSON schema: sections, keys, types, bounds, defaults."""
    return RunConfig.model_json_schema()


@router.post("/check")
async def check(body: ConfigDraft, request: Request) -> ConfigChecked:
    """Validate a draft run config as ``POST /runs`` would (its rules and this hub's
    limits): 200 with the config as JSON, or 422 ``invalid_config`` naming the key. The
    data itself (a file, a dataset) is checked only when the run is created."""
    raw = body.config
    if body.toml is not None:
        try:
            raw = tomllib.loads(body.toml)
        except tomllib.TOMLDecodeError as err:
            raise InvalidConfig(f"invalid TOML: {err}") from None
    assert raw is not None
    try:
        cfg = parse_config(raw)
    except ConfigError as err:
        raise InvalidConfig(str(err)) from None
    check_limits(cfg, request.app.state.settings)
    known = cfg.data.path is not None or cfg.model.vocab_size is not None
    params = parameter_count(cfg.model) if known else None
    return ConfigChecked(config=cfg.model_dump(mode="json"), parameters=params)
