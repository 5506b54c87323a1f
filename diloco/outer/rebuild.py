"""A published version's parameters and outer state, written by a second pass over the
close's inputs, off its critical path, and checked bit for bit against what was published.

The close (``diloco.outer.close``) writes only the delta on its critical path: the new
parameters are digested, not written, and the outer state not computed into a file. θ_v =
θ_{v−1} + decode(delta_v) would give the parameters back, but not the momentum and the
residual: those need the aggregate g. So the published try runs again
(``diloco.outer.attempt.try_step`` with ``full``): the same base version, the
contributions the close kept, in the same order, with the same weights and norms and the
same clipping history, at the same version's lr. A folded round's sum is taken from its
running sum when the caller still has it (the closer, ``Rest``), else from every kept
upload read again (any worker, after the closer died: ``rebuild``); ``diloco.outer.exact``
makes that the same sum. Given the same inputs the pass gives the same bytes; it is
checked — the delta's sha256 against the published one, the parameters' against the
recorded one — and only then are the files handed over to be committed. The delta is
written to a temp name beside ``inputs.out.delta`` for the check and removed, never
committed over the published one.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.outer.attempt import CloseInputs, StageClock, Upload, open_base, try_step
from diloco.outer.chunked import Outputs


class RebuildMismatch(RuntimeError):
    """The pass run again did not give the published bytes: nothing is committed."""


def rebuild(
    inputs: CloseInputs,
    *,
    params_sha256: str,
    delta_sha256: str,
    kept: list[Upload] | None = None,
) -> Outputs:
    """Run the version's published try again with ``kept`` (exactly those the close kept,
    in its order; None: all of ``inputs.uploads``), check the delta and the parameters
    against the published sha256s and return the outputs with the parameters and the
    outer state written, not committed (``Outputs.commit_rest``). RebuildMismatch when
    they differ, SourceUnreadable when a contribution cannot be read."""
    base = open_base(inputs)
    try:
        tried = try_step(
            inputs, base, list(inputs.uploads if kept is None else kept), StageClock(), full=True
        )
    finally:
        base.close()
    out = tried.out
    try:
        params_sha, delta_sha = out.params.sha256(), out.delta.sha256()
        out.delta.abort()  # checked: the published one stays
        if (params_sha, delta_sha) != (params_sha256, delta_sha256):
            raise RebuildMismatch(
                f"run {inputs.run_id} version {inputs.version}: the pass run again gave "
                f"parameters {params_sha} and delta {delta_sha}, the version was published "
                f"with {params_sha256} and {delta_sha256}; nothing was committed"
            )
    except BaseException:
        out.abort()
        raise
    return out


@dataclass(frozen=True)
class Rest:
    """What the close leaves to its caller once the delta is published: the version's
    parameters and outer state, to be written by the second pass (``write``) and committed
    (``Outputs.commit_rest``), off the critical path."""

    inputs: CloseInputs  # the close's own: its uploads, and its running sum if it had one
    kept: list[Upload]  # those the published step aggregated, in its order
    params_sha256: str  # what the close published
    delta_sha256: str
    params_nbytes: int
    delta_nbytes: int

    def write(self) -> Outputs:
        """The parameters and the outer state written and checked, not committed
        (``rebuild``: RebuildMismatch when the second pass differs from the first)."""
        return rebuild(
            self.inputs,
            params_sha256=self.params_sha256,
            delta_sha256=self.delta_sha256,
            kept=self.kept,
        )
