"""The hub's limits on what a run config may ask, checked when a run is created.

How a run behaves is its run config's alone (``diloco.config``: ``[rounds]`` heartbeats,
lease TTL, extensions; ``[eval]`` windows), recorded with the run and shown by ``GET
/runs/{id}``, so one config behaves the same on every hub. What a hub's operator sets
(``server.settings``) is only how much a run may cost it: a config past a limit is refused
with ``422 invalid_config`` naming the key and the limit, never quietly changed.
"""

from __future__ import annotations

from diloco.config import RunConfig
from server.http.errors import InvalidConfig
from server.settings import Settings


def check_limits(cfg: RunConfig, settings: Settings) -> None:
    """Refuse a run config that asks more of this hub than its operator allows."""
    interval, floor = cfg.rounds.heartbeat_interval_s, settings.min_heartbeat_interval_s
    if interval < floor:
        raise InvalidConfig(
            f"rounds.heartbeat_interval_s: {interval:g} s is more often than this hub takes "
            f"heartbeats (at least {floor:g} s apart, DILOCO_MIN_HEARTBEAT_INTERVAL_S)"
        )
    if cfg.eval.windows > settings.max_eval_windows:
        raise InvalidConfig(
            f"eval.windows: {cfg.eval.windows} is more than this hub scores per version "
            f"(at most {settings.max_eval_windows}, DILOCO_MAX_EVAL_WINDOWS)"
        )
