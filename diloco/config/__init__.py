"""The run config: a validated pydantic model, loaded from TOML (or JSON over the API).

Every section forbids unknown keys, and every error names the key it is about
(``inner.lr: ...``), so a typo in a config file is caught before a run starts
instead of being silently ignored for a hundred rounds.

The sections are ``diloco.config.sections`` (what is trained and sent) and
``diloco.config.rounds`` (how the hub runs the rounds); this module assembles them.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from diloco.config.rounds import (
    AggregationSection,
    AuditSection,
    EvalSection,
    RetentionSection,
    RoundsSection,
)
from diloco.config.sections import (
    BYTE_VOCAB,
    DOWNLOAD_FOR,
    INT32_MAX,
    MAX_TIMEOUT_S,
    MIN_TIMEOUT_S,
    NO_CONTROL_CHARS,
    SPARSE_OUTER,
    CompressionSection,
    DataSection,
    InnerSection,
    ModelSection,
    OuterSection,
    _Section,
)


class ConfigError(ValueError):
    """A run config that cannot be used; the message names the offending key(s)."""


class RunConfig(_Section):
    name: str = Field(min_length=1, max_length=200, pattern=NO_CONTROL_CHARS)  # runs.name
    # seeds the initial model and every lease's shard and batch sampling; None: the server
    # draws one at creation and records it here, so any run can be reproduced
    seed: int | None = Field(None, ge=0, le=(1 << 31) - 1)
    model: ModelSection = ModelSection()
    data: DataSection
    inner: InnerSection = InnerSection()
    outer: OuterSection = OuterSection()
    rounds: RoundsSection = RoundsSection()
    compression: CompressionSection = CompressionSection()
    aggregation: AggregationSection = AggregationSection()
    retention: RetentionSection = RetentionSection()
    eval: EvalSection = EvalSection()
    audit: AuditSection = AuditSection()

    @model_validator(mode="before")
    @classmethod
    def _sparse_outer_step(cls, data: Any) -> Any:
        """A sparse run whose ``[outer]`` names none of lr, momentum and nesterov takes
        ``SPARSE_OUTER``'s (one that names any keeps the others' defaults), while its
        uploads are that sparse (``CompressionSection.plain_step``)."""
        if not isinstance(data, dict) or not isinstance(data.get("compression"), dict):
            return data
        outer = data.get("outer", {})
        if data["compression"].get("kind") != "sparse" or not isinstance(outer, dict):
            return data
        if SPARSE_OUTER.keys() & outer.keys():
            return data
        try:
            plain = CompressionSection.model_validate(data["compression"]).plain_step
        except ValidationError:  # refused below, naming the key
            return data
        return {**data, "outer": {**SPARSE_OUTER, **outer}} if plain else data

    @property
    def total_inner_steps(self) -> int:
        """Inner steps a worker takes over the whole run: the cosine schedule's horizon."""
        return self.rounds.max_rounds * self.inner.steps

    @property
    def tokens_per_step(self) -> int:
        """Tokens one inner step trains on: batch_size sequences of block_size."""
        return self.inner.batch_size * self.model.block_size

    @property
    def lease_tokens(self) -> int:
        """The most tokens a lease of the nominal H can hold (H steps of batch_size x
        block_size); ``lease_tokens_for`` a lease sized otherwise."""
        return self.lease_tokens_for(self.inner.steps)

    def pinned(self) -> RunConfig:
        """The config with the choices its defaults imply written in: what a run records
        at its creation, so that it keeps them whatever later defaults say."""
        return self.model_copy(update={"compression": self.compression.pinned()})

    def lease_tokens_for(self, inner_steps: int | None) -> int:
        """The most tokens one lease's work can hold, for a lease of ``inner_steps`` (None:
        the nominal H, as a lease issued before leases were sized): a contribution's weight
        (and credit) never counts more, whatever it claims."""
        steps = self.inner.steps if inner_steps is None else inner_steps
        return steps * self.tokens_per_step


# ---------------------------------------------------------------- what a close needs


def error_message(error: ErrorDetails) -> str:
    """pydantic's message for one error, in words where it would quote our own pattern."""
    if error["type"] == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") == (
        NO_CONTROL_CHARS
    ):
        return "must not contain control characters (NUL, tab, newline, ...)"
    return error["msg"]


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = error_message(e)
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "value_error":
            # our validators say "key: sentence"; lift the key next to the section
            msg = msg.removeprefix("Value error, ")
            if ": " in msg:
                sub, msg = msg.split(": ", 1)
                key = f"{key}.{sub}" if key else sub
        lines.append(f"{key}: {msg}" if key else msg)
    return "; ".join(lines)


def parse_config(data: dict[str, Any]) -> RunConfig:
    """Validate a config given as a mapping (from TOML or JSON); raise ConfigError."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def load_config(
    path: str | Path, overrides: Mapping[str, Mapping[str, Any]] | None = None
) -> RunConfig:
    """Read and validate a TOML run config; its paths are resolved against its folder.
    ``overrides``: values put over the file's, section by section (None: the file's), before
    the config is validated, so that what a default derives from sees them too."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    for section, values in (overrides or {}).items():
        given = {k: v for k, v in values.items() if v is not None}
        if given:
            raw[section] = {**raw.get(section, {}), **given}
    cfg = parse_config(raw)
    return resolve_paths(cfg, path.parent)


def resolve_paths(cfg: RunConfig, folder: Path) -> RunConfig:
    """``data.path``, ``data.dataset`` (a folder) and ``model.init``, made absolute against
    ``folder``; a dataset id (``ds_...``) or an absolute path stays as it is."""
    data: dict[str, str] = {}
    for key in ("path", "dataset"):
        value = getattr(cfg.data, key)
        if value is not None and not value.startswith("ds_") and not Path(value).is_absolute():
            data[key] = str((folder / value).resolve())
    model: dict[str, str] = {}
    if cfg.model.init is not None and not Path(cfg.model.init).is_absolute():
        model["init"] = str((folder / cfg.model.init).resolve())
    return cfg.model_copy(
        update={
            "data": cfg.data.model_copy(update=data),
            "model": cfg.model.model_copy(update=model),
        }
    )


__all__ = [
    "BYTE_VOCAB",
    "DOWNLOAD_FOR",
    "INT32_MAX",
    "MAX_TIMEOUT_S",
    "MIN_TIMEOUT_S",
    "NO_CONTROL_CHARS",
    "SPARSE_OUTER",
    "AggregationSection",
    "AuditSection",
    "CompressionSection",
    "ConfigError",
    "DataSection",
    "EvalSection",
    "InnerSection",
    "ModelSection",
    "OuterSection",
    "RetentionSection",
    "RoundsSection",
    "RunConfig",
    "error_message",
    "load_config",
    "parse_config",
    "resolve_paths",
]
