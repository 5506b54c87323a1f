"""``diloco doctor``: can this machine usefully join this server's run, and if not, why?

Checks, in order: the device torch will train on; the server (reachable, same version); the
run to size the dry run by; one real inner step at the run's model size (speed, memory,
the round it implies against the round timeout); download and upload throughput (what a
round's checkpoint and contribution cost). Every problem comes with advice. A check that
needs an earlier one that failed is skipped, saying so.

The judgements are pure functions (``assess_*``) so their thresholds are tested directly.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from client.api import ApiError, ServerAPI, ServerUnreachable
from client.http import RetryPolicy
from client.measured_speed import MeasuredSpeed, save_speed
from diloco.config import ConfigError, RunConfig, parse_config

if TYPE_CHECKING:  # the checks import torch when they run: `diloco doctor --help` does not
    import torch

    from diloco.precision import Precision

Status = Literal["ok", "warn", "fail", "skip"]
DOCTOR_RETRY = RetryPolicy(attempts=2, base_delay_s=0.5, max_delay_s=1.0, total_s=10.0)
PROBE_BYTES = 8 << 20
MB = 1e6


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    result: str
    advice: str | None = None
    figures: dict[str, float] | None = None  # the measured numbers, for --json


@dataclass(frozen=True)
class Verdict:
    status: Status
    advice: str | None = None


# ---------------------------------------------------------------- pure judgements


def assess_round_time(step_s: float, inner_steps: int, timeout_s: float) -> Verdict:
    """H steps must fit well inside the round deadline, with room for transfers."""
    need = step_s * inner_steps
    if need > timeout_s:
        return Verdict(
            "fail",
            f"H={inner_steps} steps would take {need:.0f} s here but rounds time out after "
            f"{timeout_s:.0f} s, so no contribution could count: use a faster device "
            "(--device cuda), or ask the run's operator for a longer round timeout",
        )
    if need > 0.5 * timeout_s:
        return Verdict(
            "warn",
            f"H={inner_steps} steps take {need:.0f} s of the {timeout_s:.0f} s round timeout: "
            "a slow download or a busy machine may make you miss rounds",
        )
    return Verdict("ok")


def assess_transfer(
    direction: str, bytes_per_s: float, per_round_bytes: int, timeout_s: float
) -> Verdict:
    """A round's transfer should take a small share of the round timeout."""
    need = per_round_bytes / max(bytes_per_s, 1.0)
    if need > 0.5 * timeout_s:
        return Verdict(
            "fail" if need > timeout_s else "warn",
            f"each round's {direction} of {per_round_bytes / MB:.1f} MB would take {need:.0f} s "
            f"of the {timeout_s:.0f} s round timeout: use a faster or wired connection, or "
            "a machine closer to the server",
        )
    return Verdict("ok")


def assess_device(device: torch.device, has_nvidia_smi: bool) -> Verdict:
    if device.type != "cpu":
        return Verdict("ok")
    if has_nvidia_smi:
        return Verdict(
            "warn",
            "an NVIDIA GPU is present (nvidia-smi) but torch cannot use it: this torch is a "
            "CPU build. Re-run the installer with DILOCO_TORCH_SPEC naming a CUDA build of "
            "torch, see https://pytorch.org/get-started/locally/",
        )
    return Verdict(
        "warn",
        "no GPU: training runs on the CPU, which is fine for small models but slow for "
        "large ones; the dry run below says whether this run's rounds fit",
    )


def assess_versions(client: str, server: str) -> Verdict:
    if client == server:
        return Verdict("ok")
    return Verdict(
        "warn",
        f"this client is {client} and the server {server}: re-run the installer "
        "(curl -fsSL SERVER/install.sh | sh) to get the server's own client",
    )


# ---------------------------------------------------------------- the checks


class _Doctor:
    def __init__(
        self,
        api: ServerAPI,
        run_id: str | None,
        device: str,
        probe_bytes: int,
        *,
        precision: str = "auto",
        micro_batch: int | None = None,
        gpu_memory_gib: float | None = None,
    ) -> None:
        self.api, self.run_id, self.device_name, self.probe = api, run_id, device, probe_bytes
        self.asked_precision, self.micro_batch = precision, micro_batch
        self.gpu_memory_gib = gpu_memory_gib
        self.memory_limit: int | None = None
        self.precision: Precision | None = None
        self.run_key: str | None = None  # the run the dry run was sized by
        self.checks: list[Check] = []
        self.device: torch.device | None = None
        self.cfg: RunConfig | None = None
        self.n_params = 0
        self.server_ok = False

    def add(self, name: str, verdict: Verdict, result: str, **figures: float) -> None:
        self.checks.append(Check(name, verdict.status, result, verdict.advice, figures or None))

    def skip(self, name: str, why: str) -> None:
        self.checks.append(Check(name, "skip", why))

    def check_device(self) -> None:
        from client.gpu import MemoryLimitError, limit_memory
        from client.hardware import describe
        from client.training import DeviceError, resolve_device
        from diloco.precision import PrecisionError, choose_precision

        try:
            self.device = resolve_device(self.device_name)
        except DeviceError as err:
            self.add("device", Verdict("fail", "use --device auto or --device cpu"), str(err))
            return
        try:
            self.precision = choose_precision(self.device, self.asked_precision)
            self.memory_limit = limit_memory(self.device, self.gpu_memory_gib)
        except PrecisionError as err:
            self.precision = None
            self.add("device", Verdict("fail", "use --precision auto"), str(err))
            return
        except MemoryLimitError as err:
            self.precision = None
            self.add("device", Verdict("fail", "leave --gpu-memory out"), str(err))
            return
        hw = describe(self.device)
        verdict = assess_device(self.device, shutil.which("nvidia-smi") is not None)
        scaled = " with loss scaling" if self.precision == "fp16" else ""
        self.add("device", verdict, f"{hw.summary()}; trains in {self.precision}{scaled}")

    async def check_server(self) -> None:
        from client.hardware import client_version

        started = time.perf_counter()
        try:
            health = await self.api.healthz()
        except (ServerUnreachable, ApiError) as err:
            advice = (
                "check the URL, that the server is running, and that no firewall or proxy "
                "blocks it (try: curl -fsS SERVER/healthz)"
            )
            self.add("server", Verdict("fail", advice), str(err))
            return
        latency = time.perf_counter() - started
        server_version = str(health.get("version", "unknown"))
        verdict = assess_versions(client_version(), server_version)
        self.server_ok = True
        self.add(
            "server",
            verdict,
            f"{self.api.server_url} answers in {latency * 1000:.0f} ms, "
            f"version {server_version} (client {client_version()})",
            latency_s=latency,
        )

    async def check_run(self) -> None:
        if not self.server_ok:
            return self.skip("run", "needs the server")
        try:
            if self.run_id is None:
                active = [r for r in await self.api.list_runs() if r.get("status") == "active"]
                if not active:
                    advice = "pass --run ID to size the dry run by a run that is not active"
                    return self.add("run", Verdict("warn", advice), "the server has no active run")
                run = active[0]
            else:
                run = await self.api.get_run(self.run_id)
            self.cfg = parse_config(dict(run["config"]))
        except ApiError as err:
            return self.add("run", Verdict("fail", "check the run id: diloco run list"), str(err))
        except (ConfigError, KeyError, TypeError) as err:
            advice = "the server runs another version: re-run the installer"
            return self.add("run", Verdict("fail", advice), f"cannot read the run's config: {err}")
        self.n_params = int(run.get("n_params") or 0)
        self.run_key = str(run.get("id"))
        c = self.cfg
        self.add(
            "run",
            Verdict("ok"),
            f"{run.get('id')} ({c.name}): {self.n_params:,} parameters, H={c.inner.steps}, "
            f"batch {c.inner.batch_size}x{c.model.block_size}, "
            f"round timeout {c.rounds.timeout_s:.0f} s",
        )

    async def check_dry_run(self) -> None:
        from client.dry_run import dry_run
        from client.gpu import DoesNotFit

        if self.cfg is None or self.device is None or self.precision is None:
            return self.skip("dry run", "needs a device and a run")
        cfg, device = self.cfg, self.device
        try:
            res = await asyncio.to_thread(
                dry_run,
                cfg,
                device,
                precision=self.precision,
                micro_batch=self.micro_batch,
                memory_limit=self.memory_limit,
            )
        except DoesNotFit as err:
            advice = "use a card with more memory, or free it (close other jobs)"
            return self.add("dry run", Verdict("fail", advice), f"does not fit: {err}")
        except RuntimeError as err:  # CUDA's OutOfMemoryError is one, and so is MPS's
            if "out of memory" not in str(err).lower():
                raise
            advice = (
                f"the model does not fit on {device}; free memory (close other jobs), try a "
                "smaller --micro-batch, or use another device"
            )
            return self.add("dry run", Verdict("fail", advice), f"out of memory: {err}")
        verdict = assess_round_time(res.step_s, cfg.inner.steps, cfg.rounds.timeout_s)
        fit, batch = res.fit, cfg.inner.batch_size
        if self.run_key is not None:  # the first `diloco join` reports it (client.measured_speed)
            save_speed(
                self.run_key,
                MeasuredSpeed(res.tokens_per_s, device.type, res.precision, fit.micro_batch, batch),
            )
        util = f", MFU {res.mfu:.1%}" if res.mfu is not None else ""
        memory = f", peak memory {res.peak_bytes / 2**20:,.0f} MiB" if res.peak_bytes else ""
        if fit.total_bytes:
            memory += f" of {fit.total_bytes / 2**20:,.0f}"
        self.add(
            "dry run",
            verdict,
            f"fits at micro-batch {fit.micro_batch} of {batch} ({fit.accumulation} pass(es) a "
            f"step, {res.precision}); one inner step {res.step_s * 1000:,.0f} ms "
            f"({res.tokens_per_s:,.0f} tokens/s{util}){memory}; "
            f"a round of H={cfg.inner.steps} steps ≈ {res.step_s * cfg.inner.steps:,.0f} s",
            step_s=res.step_s,
            tokens_per_s=res.tokens_per_s,
            micro_batch=fit.micro_batch,
            accumulation=fit.accumulation,
            **({"mfu": res.mfu} if res.mfu is not None else {}),
            **({"peak_bytes": res.peak_bytes} if res.peak_bytes is not None else {}),
        )

    async def check_transfer(self, direction: str) -> None:
        if not self.server_ok:
            return self.skip(direction, "needs the server")
        probe: Callable[[int], Any] = (
            self.api.speedtest_download if direction == "download" else self.api.speedtest_upload
        )
        try:
            nbytes, seconds = await probe(self.probe)
        except (ServerUnreachable, ApiError) as err:
            advice = "the server may be too old for a speed test, or the connection drops"
            return self.add(direction, Verdict("warn", advice), str(err))
        rate = nbytes / max(seconds, 1e-9)
        # per round: the fp32 checkpoint down, about one int8 byte per parameter up
        per_round = self.n_params * (4 if direction == "download" else 1)
        timeout = self.cfg.rounds.timeout_s if self.cfg else float("inf")
        verdict = (
            assess_transfer(direction, rate, per_round, timeout) if per_round else Verdict("ok")
        )
        each = f"; ≈ {per_round / rate:,.1f} s per round" if per_round else ""
        self.add(
            direction,
            verdict,
            f"{rate / MB:,.1f} MB/s ({nbytes / MB:.1f} MB in {seconds:.2f} s){each}",
            bytes_per_s=rate,
        )


async def run_doctor(
    server_url: str,
    *,
    run_id: str | None,
    device: str,
    probe_bytes: int = PROBE_BYTES,
    precision: str = "auto",
    micro_batch: int | None = None,
    gpu_memory_gib: float | None = None,
) -> list[Check]:
    async with ServerAPI(server_url, retry=DOCTOR_RETRY) as api:
        doctor = _Doctor(
            api,
            run_id,
            device,
            probe_bytes,
            precision=precision,
            micro_batch=micro_batch,
            gpu_memory_gib=gpu_memory_gib,
        )
        doctor.check_device()
        await doctor.check_server()
        await doctor.check_run()
        await doctor.check_dry_run()
        await doctor.check_transfer("download")
        await doctor.check_transfer("upload")
        return doctor.checks


def as_json(checks: list[Check]) -> list[dict[str, Any]]:
    return [asdict(c) for c in checks]
