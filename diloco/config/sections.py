"""The run config's sections about what is trained and sent, one pydantic model each: what
``[model]``, ``[data]``, ``[inner]``, ``[outer]`` and ``[compression]`` may say, with their
bounds and defaults; and the bounds and base class every section shares. The sections about
how the hub runs the rounds (``[rounds]``, ``[eval]``, ``[aggregation]``, ``[audit]``,
``[retention]``) are ``diloco.config.rounds``. ``diloco.config`` assembles them into the
``RunConfig`` and reads it from TOML or JSON.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # the model loads torch; the config is read where torch is not wanted
    from diloco.model.gpt import GPTConfig


# Every value has an upper bound, so that nothing a config says can overflow where it goes:
# a Postgres ``integer`` (round indices, chunk lengths), a ``timedelta`` (timeouts) or a
# JSONB document (no NUL, no NaN or Infinity). Strings hold no control characters: they end
# up on the dashboard, in logs and in JSONB.
NO_CONTROL_CHARS = r"^[^\x00-\x1f\x7f]*$"
INT32_MAX = (1 << 31) - 1  # the largest Postgres ``integer``
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer than any round should wait for its quorum
MIN_TIMEOUT_S = 1.0  # no round can be trained and uploaded in less


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


BYTE_VOCAB = 256  # a text-file run's vocabulary: one token per byte


class ModelSection(_Section):
    # bounds keep shapes within what torch and safetensors index; the largest allowed model
    # is still far more than a server here can hold: run creation is admin-only
    arch: Literal["gpt", "llama"] = "gpt"  # gpt: the byte-level toy; llama: Llama family
    n_layer: int = Field(4, ge=1, le=96)
    n_head: int = Field(4, ge=1, le=128)
    n_embd: int = Field(128, ge=8, le=16384)
    block_size: int = Field(128, ge=8, le=16384)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # llama only (None: the default named; a value given for gpt is refused)
    n_kv_head: int | None = Field(None, ge=1, le=128)  # grouped-query attention; n_head
    intermediate_size: int | None = Field(None, ge=8, le=1 << 17)  # SwiGLU width
    rope_theta: float | None = Field(None, gt=0.0, le=1e9)  # 10,000
    tie_embeddings: bool | None = None  # false (gpt always ties)
    norm_eps: float | None = Field(None, gt=0.0, le=1e-2)  # RMSNorm epsilon: 1e-5
    # the vocabulary comes from the data: 256 for a text file, the tokenizer's for a prepared
    # dataset; the server records it here at creation (a value that disagrees is refused)
    vocab_size: int | None = Field(None, ge=2, le=1 << 24)
    # start from these weights instead of random ones: our safetensors checkpoint or a
    # Hugging Face model directory of the same architecture and shapes (relative paths
    # resolve against the config file); the server records the file name it was given
    init: str | None = Field(None, min_length=1, max_length=4096, pattern=NO_CONTROL_CHARS)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSection:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_head: n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})"
            )
        if self.arch == "gpt":
            for key in ("n_kv_head", "intermediate_size", "rope_theta", "norm_eps"):
                if getattr(self, key) is not None:
                    raise ValueError(f'{key}: only for arch = "llama"')
            if self.tie_embeddings is False:
                raise ValueError('tie_embeddings: arch = "gpt" always ties its embeddings')
            return self
        if self.n_head % self.kv_heads:
            raise ValueError(
                f"n_kv_head: n_head ({self.n_head}) must be a multiple of n_kv_head "
                f"({self.kv_heads})"
            )
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(
                "n_head: RoPE needs an even head size, "
                f"n_embd / n_head = {self.n_embd // self.n_head}"
            )
        return self

    @property
    def vocab(self) -> int:
        return self.vocab_size if self.vocab_size is not None else BYTE_VOCAB

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    def gpt_config(self) -> GPTConfig:
        from diloco.model.gpt import GPTConfig

        return GPTConfig(
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            block_size=self.block_size,
            dropout=self.dropout,
            vocab_size=self.vocab,
        )


class DataSection(_Section):
    # exactly one of: a text file (byte-level, split by the server at creation), or a
    # prepared dataset (``diloco data prepare``): a local folder in a config file, which
    # ``diloco run create`` uploads and replaces by its id (``ds_...``) in the request.
    # Relative paths resolve against the config file (4096: Linux's PATH_MAX)
    path: str | None = Field(None, min_length=1, max_length=4096, pattern=NO_CONTROL_CHARS)
    dataset: str | None = Field(None, min_length=1, max_length=4096, pattern=NO_CONTROL_CHARS)
    # text files only:
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    # bytes per chunk dealt round-robin to the shards (i.i.d.-like shards);
    # 0: one contiguous block per shard (each worker sees one part of the corpus).
    # At most 1 GiB: the chunk length is stored as a Postgres integer
    chunk_size: int = Field(8192, ge=0, le=1 << 30)

    @model_validator(mode="after")
    def _one_source(self) -> DataSection:
        if (self.path is None) == (self.dataset is None):
            raise ValueError(
                "path: give exactly one of data.path (a text file) and data.dataset "
                "(a folder made by `diloco data prepare`)"
            )
        return self


class InnerSection(_Section):
    steps: int = Field(50, ge=1, le=100_000)  # H: AdamW steps per round (the nominal H)
    # bounds on one lease's H, which the server sizes to the volunteer's measured speed so
    # that it finishes before the round's deadline (diloco.protocol.sizing); a volunteer of
    # unknown speed gets `steps`. None: max(1, steps // 4) and steps, so a fast volunteer
    # trains what every lease trained before. min_steps <= steps <= max_steps
    min_steps: int | None = Field(None, ge=1, le=100_000)
    max_steps: int | None = Field(None, ge=1, le=100_000)
    batch_size: int = Field(16, ge=1, le=4096)  # sequences per step
    lr: float = Field(1e-3, gt=0.0, le=1.0)
    weight_decay: float = Field(0.1, ge=0.0, le=1.0)
    # counted in global inner steps, not per round; ten million: more than any warm-up needs
    warmup_steps: int = Field(20, ge=0, le=10_000_000)
    grad_clip: float = Field(1.0, ge=0.0, le=1e6)  # 0 disables clipping; 1e6 never clips
    schedule: Literal["cosine", "constant"] = "cosine"  # cosine decays over max_rounds * steps
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)  # cosine floor, as a fraction of lr
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    # zero AdamW's first moment (exp_avg) when a lease starts, keeping the second moment and
    # the step count (so no bias correction: the momentum rebuilds over ~1 / (1 - beta1)
    # steps). A worker's momentum from its last round points where the outer step has
    # already gone (docs/tuning-notes.md); false keeps it, as published DiLoCo does
    reset_momentum: bool = True
    # overlap (issue 25): after its upload a volunteer goes on training, from its own end of
    # the round, on its last lease's data, while the round closes and the next version
    # travels; the real version is then folded in (InnerTrainer.fold) and those steps count
    # as the first of its next lease's H (``ahead_cap``). 0: it waits, as before
    overlap: float = Field(0.0, ge=0.0, le=0.9)

    @model_validator(mode="after")
    def _steps_within_bounds(self) -> InnerSection:
        if self.min_steps is not None and self.min_steps > self.steps:
            raise ValueError(
                f"min_steps: min_steps ({self.min_steps}) must be at most steps ({self.steps})"
            )
        if self.max_steps is not None and self.max_steps < self.steps:
            raise ValueError(
                f"max_steps: max_steps ({self.max_steps}) must be at least steps ({self.steps})"
            )
        return self

    @property
    def lease_min_steps(self) -> int:
        """The fewest inner steps a lease is sized to (``min_steps``, else steps // 4)."""
        return self.min_steps if self.min_steps is not None else max(1, self.steps // 4)

    @property
    def lease_max_steps(self) -> int:
        """The most inner steps a lease is sized to (``max_steps``, else ``steps``)."""
        return self.max_steps if self.max_steps is not None else self.steps

    def ahead_cap(self, lease_steps: int) -> int:
        """The most steps a volunteer trains ahead (``overlap``) after a lease of
        ``lease_steps``: that share of them, leaving at least one for the next lease's own
        data. The client and the simulator's volunteers both stop here."""
        share = int(self.overlap * lease_steps + 1e-9)  # 0.3 x 10 is 3, not 2.9999...
        return max(0, min(share, lease_steps - 1))


# the outer step a sparse run gets when its [outer] names none of these: SparseLoCo's plain
# step (no server momentum: the volunteers' error feedback carries what momentum would),
# with a larger lr than Nesterov's (docs/tuning-notes.md, "Sparse uploads: the outer step")
SPARSE_OUTER = {"lr": 3.0, "momentum": 0.0, "nesterov": False}
# ... while its uploads keep at most this share of each chunk: the less error feedback holds
# back, the less it acts as momentum; at 2048 of 4096 Nesterov's defaults measured +1.16%
# against int8 where the plain step measured +14% (docs/tuning-notes.md, "Sparse uploads,
# denser"); a denser sparse run keeps Nesterov's defaults (``CompressionSection.plain_step``)
SPARSE_PLAIN_MAX_SHARE = 0.25


class OuterSection(_Section):
    lr: float = Field(0.7, gt=0.0, le=10.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    nesterov: bool = True
    # the start of a run (``lr_at``): with first_round = "average" (the default) round 1
    # moves the model by exactly the averaged update (θ₁ = θ₀ − Δ₁: lr 1 / (1 + momentum)
    # under Nesterov, whose first step is lr (1 + momentum) Δ = 1.33 Δ at the defaults and
    # raised the demo's eval loss 1.48x on one seed in three); round t <= warmup_rounds steps
    # with lr x t / warmup_rounds. bench/first_round.py measured them (docs/benchmarks.md):
    # "average" removes the spike everywhere at <= 0.2% of final loss; a 3-round warmup also
    # does, but ends 2.5% worse at H = 50
    warmup_rounds: int = Field(0, ge=0, le=100_000)
    first_round: Literal["nesterov", "average"] = "average"
    # the outer lr across the run (``lr_at``): lr at round 1, rising along a half cosine to
    # lr x lr_rise at the run's last round ([rounds] max_rounds). The workers' inner lr decays
    # over the run (cosine to 10%), so each round's averaged update shortens; a rising outer
    # lr takes longer steps with it. Seed 0 of the Llama + BPE table (docs/tuning-notes.md,
    # "The outer lr across the run"): a rise to 2x at H = 10 (40 rounds) recovers 78%
    # instead of 68% of the gap at K = 4, 70% instead of 61% at K = 8; but it is within
    # +-0.7% at H = 25 and 50 and 8-10% worse on the byte-level GPT, so the default stays
    # 1 (constant). A decay (below 1) measured far worse and is refused
    lr_rise: float = Field(1.0, ge=1.0, le=10.0)

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OuterSection:
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("nesterov: Nesterov momentum needs momentum > 0; set nesterov = false")
        return self

    def lr_at(self, round_index: int, rounds: int) -> float:
        """The outer learning rate of round ``round_index`` (from 1) of a run of ``rounds``
        (its max_rounds): what its step applies."""
        if not round_index >= 1:
            raise ValueError(f"rounds are numbered from 1, got {round_index}")
        if self.first_round == "average" and round_index == 1:
            return 1.0 / (1.0 + self.momentum) if self.nesterov else 1.0
        # past the last round (late work merged after the end, a raised max_rounds): the end's
        t = min(round_index - 1, rounds - 1) / max(rounds - 1, 1)
        lr = self.lr * (1.0 + (self.lr_rise - 1.0) * (1.0 - math.cos(math.pi * t)) / 2.0)
        if self.warmup_rounds and round_index <= self.warmup_rounds:
            return lr * round_index / self.warmup_rounds
        return lr


# the download codec a run gets when its [compression] names none, by upload kind: the
# same family as its uploads (docs/tuning-notes.md, "Compressed downloads")
DOWNLOAD_FOR = {"int8": "int8", "none": "int8", "int4": "int4", "int2": "int4", "sparse": "sparse"}
# a sparse delta's top-k per chunk when the config names none: the round's aggregate of K
# sparse uploads is K times as dense as one (docs/tuning-notes.md, "Compressed downloads")
DOWNLOAD_TOPK_PER_UPLOAD_TOPK = 8
# the scale block a kind gets when its [compression] names none (else 4096): int2's three
# levels lose far less in blocks of 256, for 1/64 byte more a value (docs/tuning-notes.md,
# "int2's block")
BLOCK_FOR = {"int2": 256}


class CompressionSection(_Section):
    """How uploads are compressed (``diloco.wire``): int8 or fp32 ("none") per value; int4
    or int2 per value with error feedback; sparse: per ``chunk`` values the ``topk``
    largest of the error-feedback accumulator, ``bits``-bit codes (diloco.wire.lowbit).
    ``block_size`` is the int8/int4/int2 scale block (left out: 4096, int2's
    ``BLOCK_FOR``); ``ef_decay`` weighs the residual
    carried into the next round (a = ef_decay·e + Δ).

    ``download`` is the codec of the deltas between published versions, what a returning
    volunteer downloads (``diloco.wire.delta``; the server keeps their residual): int8,
    int4, int2 or sparse (its chunk and bits are the uploads', its top-k
    ``download_topk``, by default 8 × ``topk``). Left out, it follows ``kind``
    (``DOWNLOAD_FOR``, int8 for a sparse run as dense as ``download_kind`` says) and a run
    records the one it uses (``RunConfig.pinned``)."""

    kind: Literal["int8", "none", "int4", "int2", "sparse"] = "int8"
    block_size: int = Field(4096, ge=64, le=1 << 24)
    chunk: int = Field(4096, ge=2, le=1 << 16)
    topk: int = Field(64, ge=1, le=1 << 16)
    bits: Literal[1, 2, 3, 4, 8] = 2
    ef_decay: float = Field(1.0, ge=0.0, le=1.0)
    download: Literal["int8", "int4", "int2", "sparse"] | None = None
    download_topk: int | None = Field(None, ge=1, le=1 << 16)

    @model_validator(mode="before")
    @classmethod
    def _block_for_the_kind(cls, data: Any) -> Any:
        """``block_size`` left out: the kind's (``BLOCK_FOR``), written in, so a run
        records it."""
        if isinstance(data, dict) and "block_size" not in data:
            block = BLOCK_FOR.get(data.get("kind", "int8"))
            if block is not None:
                return {**data, "block_size": block}
        return data

    @model_validator(mode="after")
    def _topk_fits_the_chunk(self) -> CompressionSection:
        for key, topk in (("topk", self.topk), ("download_topk", self.download_topk)):
            if topk is not None and topk > self.chunk:
                raise ValueError(f"{key}: {topk} values cannot be kept of a chunk of {self.chunk}")
        return self

    @property
    def download_kind(self) -> str:
        """The published deltas' codec: ``download``, else the one ``kind`` implies; for a
        sparse run whose default delta (8 × ``topk``, no ``download_topk``) would keep more
        than half of each chunk, int8: fewer bytes than a sparse record of every other
        value (index and code) and exact to int8."""
        if self.download is not None:
            return self.download
        dense = self.download_topk is None and self.download_k > self.chunk // 2
        if self.kind == "sparse" and dense:
            return "int8"
        return DOWNLOAD_FOR[self.kind]

    @property
    def plain_step(self) -> bool:
        """Whether a run of these uploads takes ``SPARSE_OUTER`` when its [outer] names no
        step: sparse ones that keep at most ``SPARSE_PLAIN_MAX_SHARE`` of each chunk."""
        return self.kind == "sparse" and self.topk <= SPARSE_PLAIN_MAX_SHARE * self.chunk

    @property
    def download_k(self) -> int:
        """A sparse delta's top-k per chunk: ``download_topk``, else 8 × ``topk`` (at most
        the chunk)."""
        return self.download_topk or min(self.chunk, DOWNLOAD_TOPK_PER_UPLOAD_TOPK * self.topk)

    def pinned(self) -> CompressionSection:
        """This section with the download codec it implies written in (what a run records)."""
        return self.model_copy(
            update={"download": self.download_kind, "download_topk": self.download_k}
        )
