"""What ``diloco simulate``'s options become: the run config with the command line's
overrides, the device, protocol mode's options; each bad value a usage error (exit 2)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client.cli.support import ExitStatus, fail
from diloco.config import ConfigError, RunConfig, load_config

if TYPE_CHECKING:  # imported where used: they load torch
    from diloco.simulate.protocol_mode import Links, Outage, ProtocolOptions


class SimMode(StrEnum):
    diloco = "diloco"  # K workers, H inner steps per round, outer Nesterov step
    ddp = "ddp"  # one model, K x the batch per step
    single = "single"  # one worker, 1 x the batch
    protocol = "protocol"  # K volunteers against the round protocol, on a simulated clock


def run_config(config: Path, overrides: dict[str, dict[str, Any]]) -> RunConfig:
    """The run config at ``config`` with the command line's values over it, section by
    section (None: the file's value), validated again; a usage error otherwise."""
    try:
        return load_config(config, overrides)
    except ConfigError as err:
        fail(str(err), ExitStatus.USAGE)


def numbers(option: str, text: str | None) -> tuple[float, ...] | None:
    """``--speeds 1,1,0.5``: comma-separated numbers, or a usage error naming the option."""
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        fail(f"{option} takes comma-separated numbers, not {text!r}", ExitStatus.USAGE)


def outage_of(text: str) -> Outage:
    """``--outage 2@30:90``: volunteer 2 offline from 30 s to 90 s (``2@30``: for good)."""
    from diloco.simulate.protocol_mode import Outage

    try:
        who, _, when = text.partition("@")
        at, _, back = when.partition(":")
        return Outage(int(who), float(at), float(back) if back else None)
    except ValueError:
        fail(f"--outage takes VOLUNTEER@START[:END] in seconds, not {text!r}", ExitStatus.USAGE)


def check_choices(
    drop_prob: float, single_data: str, batches: str, downloads: str, overlap: float | None = None
) -> None:
    if not 0.0 <= drop_prob < 1.0:
        fail(f"--drop-prob must be in [0, 1), not {drop_prob}", ExitStatus.USAGE)
    if overlap is not None and not 0.0 <= overlap <= 0.9:
        fail(f"--overlap must be in [0, 0.9], not {overlap}", ExitStatus.USAGE)
    for option, value, allowed in (
        ("--single-data", single_data, ("shard", "all")),
        ("--batches", batches, ("worker", "lease")),
        ("--downloads", downloads, ("full", "delta")),
    ):
        if value not in allowed:
            fail(f"{option} must be {' or '.join(allowed)}, not {value!r}", ExitStatus.USAGE)


def device_for(name: str, threads: int | None) -> str:
    """The device every worker trains on (``client.training.resolve_device``, as the
    volunteer client chooses its own), after setting torch's CPU threads."""
    import torch

    from client.training import DeviceError, resolve_device

    if threads:
        torch.set_num_threads(threads)
    try:
        return str(resolve_device(name))
    except DeviceError as err:
        fail(str(err), ExitStatus.USAGE)


def protocol_options(
    mode: SimMode,
    K: int,
    *,
    speeds: tuple[float, ...] | None,
    step_s: float,
    join_at: tuple[float, ...] | None,
    drop_per_min: float,
    return_per_min: float,
    outages: tuple[Outage, ...],
    sweep_interval_s: float,
    close_s: float,
    max_sim_s: float | None,
    size_h: bool,
    links: Links | None,
) -> ProtocolOptions | None:
    """Protocol mode's options, checked against K; None in the other modes, which refuse
    them (ValueError)."""
    from diloco.simulate.hub import HubSettings
    from diloco.simulate.protocol_mode import ProtocolOptions

    if mode is not SimMode.protocol:
        if speeds or join_at or outages or drop_per_min or return_per_min or size_h or links:
            raise ValueError(
                "--speeds, --join-at, --outage, --drop-per-min, --return-per-min, --size-h "
                "and --link apply to --mode protocol only"
            )
        return None
    return ProtocolOptions(
        speeds=speeds,
        step_s=step_s,
        join_at_s=join_at,
        drop_per_min=drop_per_min,
        return_per_min=return_per_min,
        outages=outages,
        hub=HubSettings(sweep_interval_s=sweep_interval_s, close_s=close_s),
        max_sim_s=max_sim_s,
        size_h=size_h,
        links=links,
    ).checked(K)


def refuse_misfits(
    mode: SimMode, *, drop_prob: float, batches: str, downloads: str, overlap: float | None = None
) -> None:
    """ValueError for an option that does not apply to ``mode``."""
    if overlap and mode not in (SimMode.diloco, SimMode.protocol):
        raise ValueError("--overlap applies to --mode diloco and protocol")
    if drop_prob and mode is SimMode.protocol:
        raise ValueError("--drop-prob: protocol mode drops volunteers (--drop-per-min)")
    if batches != "worker" and mode is SimMode.protocol:
        raise ValueError("--batches: protocol mode always deals leases as the platform does")
    if downloads != "full" and mode not in (SimMode.diloco, SimMode.protocol):
        raise ValueError(f"--downloads {downloads} applies to --mode diloco and protocol")


def links_of(text: str | None, as_params: float | None) -> Links | None:
    """``--link 20/100/40``: up and down megabits per second, then an optional latency in
    ms; a ValueError for a malformed or impossible link."""
    from diloco.simulate.protocol_mode import Links

    if text is None:
        if as_params is not None:
            raise ValueError("--link-as-params sizes the transfers of --link: give --link too")
        return None
    parts = text.split("/")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        up, down, *latency = (float(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"--link takes UP/DOWN[/LATENCY_MS], e.g. 20/100/40, not {text!r}"
        ) from None
    return Links(up, down, latency[0] / 1000 if latency else 0.0, as_params)
