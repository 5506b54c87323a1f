"""The server's side of a round, in the simulator: what ``server.rounds.ingest`` and
``server.rounds.outer_step`` do, on uploads held in memory.

- ``RoundDesk.admit``: an upload as the server takes it: the body decoded and checked
  (``diloco.wire``), every tensor decoded to finite values and measured
  (``diloco.robust.UploadInspector``), its header against the round (``admit_claim``),
  a replay of another's tensors refused (``admit_payload``), its weight capped at what
  a lease allows (``upload_weight``) and, for late work merged into this round from an
  earlier one (``origin``), discounted by its staleness (``late_weight``).
- ``RoundDesk.close``: the guarded step (``diloco.guard``) over the robust aggregate
  (``diloco.robust``), from a copy of the global optimizer.

Both modes of ``diloco simulate`` that train through the wire format use it, so an attack
in the simulator meets exactly the defences it meets on a server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import torch

from diloco.architectures import parameter_shapes
from diloco.codec import make_codec
from diloco.config import RunConfig
from diloco.guard import Stepped, guarded_step
from diloco.outer import OuterOptimizer
from diloco.protocol.late import late_weight
from diloco.protocol.messages import ErrorCode
from diloco.protocol.rules import admit_claim, admit_payload, upload_weight
from diloco.protocol.state import Refusal, RoundState, RoundView, UploadClaim
from diloco.robust import Source, UploadInspector, robust_aggregate
from diloco.wire import ContributionDecoder, NonFiniteWireError, WireFormatError

SIM_RUN_ID = "simulate"  # the run id in every simulated upload's header
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Admitted:
    source: Source
    contributor: str
    loss: float  # the contributor's mean inner loss, as its header says
    tokens: int  # its weight: what it counts for in the step and in credit
    staleness: int = 0  # late work: versions published since its base (0: fresh)


@dataclass
class RoundDesk:
    """One round's uploads, admitted one by one, then closed."""

    cfg: RunConfig
    round: RoundView
    admitted: list[Admitted] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)  # by error code
    _payloads: set[str] = field(default_factory=set)

    def admit(
        self,
        source_id: str,
        contributor: str,
        chunks: list[bytes],
        inner_steps: int | None = None,
        *,
        origin: RoundView | None = None,
        staleness: int = 0,
    ) -> Admitted | Refusal:
        """An upload for a lease of ``inner_steps`` (None: the run's steps), checked and
        weighed as the server does, or refused. ``origin``: the round a late upload was
        trained for (its header is checked against that round), merged into this one
        ``staleness`` versions on."""
        shapes, codec = _model(self.cfg)
        decoder = ContributionDecoder(shapes, codec=codec)
        inspector = UploadInspector(codec)
        try:
            for chunk in chunks:
                for name, encoded in decoder.feed(chunk):
                    inspector.add(name, encoded)
            decoder.finish()
        except NonFiniteWireError as err:
            return self._refuse(Refusal(ErrorCode.NON_FINITE, str(err)))
        except WireFormatError as err:
            return self._refuse(Refusal(ErrorCode.MALFORMED_UPLOAD, str(err)))
        assert decoder.header is not None
        meta = decoder.header.meta
        claim = UploadClaim(
            SIM_RUN_ID, meta.round, meta.base_version, meta.tokens, meta.inner_steps
        )
        refusal = admit_claim(claim, run_id=SIM_RUN_ID, round=origin or self.round)
        refusal = refusal or admit_payload(inspector.payload_sha256 in self._payloads)
        if refusal is not None:
            return self._refuse(refusal)
        self._payloads.add(inspector.payload_sha256)
        weight = late_weight(
            upload_weight(meta.tokens, self.cfg.lease_tokens_for(inner_steps)), staleness
        )
        source = Source(source_id, float(weight), inspector.norm, lambda: chunks)
        admitted = Admitted(source, contributor, meta.loss, weight, staleness)
        self.admitted.append(admitted)
        return admitted

    def _refuse(self, refusal: Refusal) -> Refusal:
        self.refused[str(refusal.code)] = self.refused.get(str(refusal.code), 0) + 1
        return refusal

    def close(
        self,
        outer: OuterOptimizer,
        *,
        evaluate: Callable[[Mapping[str, torch.Tensor]], float],
        base_loss: float | None,
        history: list[float],
        quorum: int = 1,
    ) -> Stepped:
        """The guarded step from ``outer`` (left untouched: the result is a copy)."""
        shapes, codec = _model(self.cfg)
        return guarded_step(
            [a.source for a in self.admitted],
            start=outer.clone,
            aggregate=lambda sources: robust_aggregate(
                sources, shapes=shapes, codec=codec, policy=self.cfg.aggregation, history=history
            ),
            evaluate=evaluate,
            base_loss=base_loss,
            max_loss_ratio=self.cfg.aggregation.max_loss_ratio,
            quorum=quorum,
            lr=self.cfg.outer.lr_at(self.round.index),
        )


def open_round(cfg: RunConfig, index: int) -> RoundDesk:
    """A desk for round ``index`` of diloco mode (which has no clock: the times are moot)."""
    return RoundDesk(cfg, RoundView(index, EPOCH, EPOCH, RoundState.OPEN))


def _model(cfg: RunConfig) -> tuple[dict[str, tuple[int, ...]], dict]:
    shapes = parameter_shapes(cfg.model)
    return shapes, make_codec(cfg.compression.kind, cfg.compression.block_size).describe()
