"""Server settings: one pydantic-settings object read from ``DILOCO_*`` environment variables.

``diloco serve`` fills in the data dir and database URL from its options; everything else
has a default a laptop demo can use. The admin token is a ``SecretStr`` so that it never
shows up in a repr or a log line.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path

from limits import parse_many
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Role(StrEnum):
    """What one ``diloco serve`` process does; several processes may share one Postgres."""

    ALL = "all"  # the API and the round work (the default; a laptop needs nothing else)
    API = "api"  # the HTTP API and dashboard only: no round is decided or closed here
    WORKER = "worker"  # decides and closes rounds; serves only /healthz and /metrics


# settings that moved into the run config (diloco.config), and where they went
RETIRED = {
    "HEARTBEAT_INTERVAL_S": "[rounds] heartbeat_interval_s",
    "LEASE_TTL_S": "[rounds] lease_ttl_s",
    "MAX_EXTENSIONS": "[rounds] max_extensions",
    "EVAL_WINDOWS": "[eval] windows",
}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DILOCO_", extra="ignore")

    data_dir: Path = Path("diloco-data")  # blobs, checkpoints, shards, embedded Postgres
    database_url: str = ""  # postgresql://...; empty: the embedded Postgres under data_dir
    admin_token: SecretStr | None = None  # None: generated into <data_dir>/admin-token
    # where blobs live (server.storage.base.open_storage): file:///dir, or s3://bucket/prefix with
    # the AWS_* variables; empty: <data_dir>/blobs on this machine's disk
    storage: str = ""
    # the store's address as volunteers reach it, when it differs from AWS_ENDPOINT_URL (a
    # compose network's http://minio:9000 is http://HOST:9000 outside): signed URLs name it
    storage_public_endpoint: str = ""
    # where a replica on object storage stages the close's files (None: the system temp dir)
    scratch_dir: Path | None = None
    # published checkpoint files (params and state), fetched uploads and data a worker keeps
    # there, uploads out first, then the least recently used: the next close's base and the
    # eval's file need not come back from the bucket, nor an upload for its fold, score and
    # close, nor a shard for each score (12 bytes per parameter a version; 0: keep none)
    scratch_cache_bytes: int = Field(16 << 30, ge=0)
    # how long the signed URLs of direct transfers live: downloads, and an upload's PUT
    # (at least until its round's deadline, and this much longer)
    signed_url_ttl_s: int = Field(3600, ge=60, le=7 * 24 * 3600)
    # a CDN (or public bucket) base URL serving the store's keys: checkpoints, deltas and
    # shards are then handed out as <base>/<key>, unsigned and cacheable; empty: signed URLs
    public_read_url: str = ""
    # GET /runs/{id}/storage answers a listing at most this old (listing costs the store)
    storage_usage_max_age_s: float = Field(30.0, ge=0, le=86400)

    # rounds (the bounds keep every deadline and expiry a representable date). How a run's
    # rounds behave (heartbeats, lease TTL, extensions, eval windows) is its run config's
    # alone; the hub only sets limits on what a run config may ask (checked at creation)
    # how often the sweeper asks decide_close
    sweep_interval_s: float = Field(1.0, gt=0, le=3600)
    # the most often volunteers may be asked to heartbeat: a run config whose [rounds]
    # heartbeat_interval_s is shorter is refused (the hub's heartbeat load is volunteers / this)
    min_heartbeat_interval_s: float = Field(1.0, ge=1.0, le=3600)
    # heartbeats a second the hub asks of all its volunteers together (the sum over its API
    # processes: raise it with each process added): leases and heartbeat answers advise a
    # longer interval than the run's when its live leases would send more
    # (diloco.protocol.heartbeats; never past a third of the run's lease_ttl_s). 500: what
    # one process served with room to spare on a 2-core machine (docs/benchmarks.md)
    heartbeat_budget_per_s: float = Field(500.0, gt=0, le=1e6)
    # how often each process asks the database for the hub's live leases (the advice's
    # load); the same answer is /healthz's proof that the database answers
    pulse_interval_s: float = Field(2.0, gt=0, le=60)
    role: Role = Role.ALL
    close_concurrency: int = Field(2, ge=1, le=64)  # rounds one process closes at a time
    close_nice: int = Field(10, ge=0, le=19)  # close threads run this much nicer (0: not)
    # a close's claim lapses unless renewed this often
    claim_ttl_s: float = Field(60.0, gt=0, le=86400)
    # backoff after a failed close: base · 2^(n-1), at most max
    close_retry_base_s: float = Field(2.0, gt=0, le=86400)
    close_retry_max_s: float = Field(300.0, gt=0, le=86400)
    # tests only: make this process fail or die at named points (diloco.faults; e.g.
    # "close.write=die"). Empty in production.
    faults: str = ""

    # data and uploads
    n_shards: int = Field(8, ge=1, le=4096)  # training shards a run's data is split into
    max_data_bytes: int = Field(1 << 30, gt=0)  # the data file uploaded with a run
    # what one run owner's runs may cost where the admin set it no quota of its own (PUT
    # /api/v1/contributors/{id}/quota; server.accounts.quotas): runs not ended at once, a
    # run's model parameters, a run's training data in bytes. The admin's own runs are
    # bounded by the hub's limits alone
    owner_runs: int = Field(2, ge=0, le=10_000)
    owner_params: int = Field(100_000_000, ge=0)
    owner_data_bytes: int = Field(256 << 20, ge=0)

    # webhooks (server.webhooks): networks a webhook may reach besides public addresses
    # ("127.0.0.0/8,10.0.0.0/8"; empty: none: loopback, private, link-local and metadata
    # addresses are refused when a webhook is set and at each delivery)
    webhook_allow_networks: str = ""
    webhook_timeout_s: float = Field(10.0, gt=0, le=300)  # one POST, answer included
    # a failed delivery is tried again after base x 2^(n-1) s (at most an hour), n times
    webhook_retry_base_s: float = Field(5.0, gt=0, le=3600)
    webhook_max_attempts: int = Field(8, ge=1, le=100)
    webhook_poll_s: float = Field(1.0, gt=0, le=3600)  # how often due deliveries are looked for
    # round.close_failing is sent when a round's failed close attempts reach this
    webhook_close_failures: int = Field(3, ge=1, le=1000)
    # starting weights uploaded with a run (model.init): at most this, and at most the
    # run's own model in fp32 (plus a header); 16 GiB is a 4B-parameter model
    max_init_bytes: int = Field(16 << 30, gt=0)
    upload_slack_bytes: int = Field(1 << 16, ge=0)  # header room above the exact body size
    # the most validation windows a run config's [eval] windows may ask the server to score
    # per version (each eval costs the server that many forward passes)
    max_eval_windows: int = Field(1024, ge=1)
    # torch's intra-op threads in the server. 1 by default: the server's threads (requests,
    # the close, the eval, upload digests) already share the cores, and an op split over
    # threads waits for the slowest one; with one core busy, the close's pass measured 4-10x
    # slower at 2 threads than at 1 here (docs/benchmarks.md). 0: torch's default.
    torch_threads: int = Field(1, ge=0)

    # hostile traffic: what one connection, upload or run may cost (server.http.connection,
    # server.http.body_timeout, server.rounds.slots, run creation)
    # a request's line and headers must arrive within this, from the connection's start or
    # the previous answer's end; else 408 and the connection is closed
    header_timeout_s: float = Field(10.0, gt=0, le=3600)
    # a request body that sends nothing for this long is dropped (408; an upload's temp blob
    # is removed)
    body_idle_timeout_s: float = Field(30.0, gt=0, le=3600)
    # request line + headers; more is 431 (a volunteer's requests send under 1 KiB)
    max_header_bytes: int = Field(64 << 10, ge=1024, le=16 << 20)
    # uploads this process receives at once, in all and per contributor; more is 429
    max_uploads_in_flight: int = Field(256, ge=1, le=100_000)
    max_uploads_per_contributor: int = Field(2, ge=1, le=1000)
    # the memory the round closes of this process may use together (close_concurrency of
    # them at once): a run whose close would need more than its share is refused at
    # creation (422 model_too_large). None: half of this machine's physical memory
    close_memory_budget_bytes: int | None = Field(None, ge=1 << 20)

    # the janitor (server.upkeep.janitor): what interrupted work left behind in the data dir
    janitor_interval_s: float = Field(600.0, gt=0)  # between passes; the first runs at start
    # a leftover is removed only once its mtime is this old: anything younger may be a write
    # in progress, here or in another server on the same data dir
    temp_max_age_s: float = Field(3600.0, ge=60)

    # the volunteer installer (GET /install.sh) and the client wheel under /downloads/
    public_url: str | None = None  # what volunteers reach us at; None: each request's base URL
    client_wheel: Path | None = None  # a prebuilt diloco_hub-*.whl; None: build from source

    # rate limits per client address (server.http.ratelimit), in the ``limits`` notation:
    # "20/hour", several as "5/minute;100/day"; empty: no limit
    rate_register: str = "20/hour"  # POST /api/v1/contributors
    rate_speedtest: str = "30/hour"  # GET and POST /api/v1/speedtest, counted together
    rate_upload: str = "600/hour"  # PUT .../contribution: one per round per volunteer

    def rate_limit(self, action: str) -> str:
        return str(getattr(self, f"rate_{action}"))

    @field_validator("rate_register", "rate_speedtest", "rate_upload")
    @classmethod
    def _rate(cls, rule: str) -> str:
        rule = rule.strip()
        if rule:
            try:
                items = parse_many(rule)
            except ValueError as err:
                raise ValueError(
                    f"{rule!r} is not a rate limit like '20/hour' or '5/minute;100/day' ({err})"
                ) from None
            if any(item.amount < 1 for item in items):
                raise ValueError(f"{rule!r}: a limit of 0 refuses everything; empty means none")
        return rule

    @field_validator("public_url", "client_wheel", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value  # KEY= in a compose file means "not set"

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, url: str) -> str:
        # accept the plain libpq form operators paste; SQLAlchemy needs the asyncpg driver
        for prefix in ("postgresql://", "postgres://"):
            if url.startswith(prefix):
                return "postgresql+asyncpg://" + url.removeprefix(prefix)
        if url and not url.startswith("postgresql+asyncpg://"):
            raise ValueError("database_url: must be a postgresql:// URL")
        return url

    @model_validator(mode="after")
    def _no_retired_variables(self) -> Settings:
        """A variable that once set a run's behaviour is refused, not silently ignored."""
        for name, moved in RETIRED.items():
            if f"DILOCO_{name}" in os.environ:
                raise ValueError(
                    f"DILOCO_{name} is no longer a server setting: a run's {moved} is in its "
                    "run config now (docs/operations.md); unset it"
                )
        return self

    @property
    def close_memory_budget(self) -> int:
        """``close_memory_budget_bytes``, or half of the physical memory when unset."""
        if self.close_memory_budget_bytes is not None:
            return self.close_memory_budget_bytes
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2

    @property
    def close_memory_share(self) -> int:
        """What one close may use: the budget over the closes that may run at once."""
        return self.close_memory_budget // self.close_concurrency
