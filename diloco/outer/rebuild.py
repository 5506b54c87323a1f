"""A published version's parameters and outer state, rebuilt bit for bit when the close
that published it died before committing them (``diloco.outer.close`` commits the delta
first and leaves them to its caller).

θ_v = θ_{v−1} + decode(delta_v) would give the parameters back, but not the momentum and
the residual: those need the aggregate g. So the rebuild runs the published try again
(``diloco.outer.attempt.try_step``): the same base version, the contributions the close
kept, in the same order, with the same weights and norms and the same clipping history,
at the same version's lr (a folded round: with its plan, every kept upload read again, as
the running sum stayed with the closer; ``diloco.outer.exact`` makes that the same sum).
Given the same inputs the pass writes the same bytes; the
rebuild checks that it did — the delta's sha256 against the published one, the
parameters' against the recorded one — and only then hands the files over to be
committed. The delta itself is written to ``inputs.out.delta`` (a scratch path of the
caller's), never over the published one.
"""

from __future__ import annotations

from diloco.outer.attempt import CloseInputs, StageClock, open_base, try_step
from diloco.outer.chunked import Outputs


class RebuildMismatch(RuntimeError):
    """The pass run again did not give the published bytes: nothing is committed."""


def rebuild(inputs: CloseInputs, *, params_sha256: str, delta_sha256: str) -> Outputs:
    """Run the version's published try again with ``inputs.uploads`` (exactly those the
    close kept, in its order), check the delta and the parameters against the published
    sha256s and return the outputs with the parameters and the outer state written, not
    committed (``Outputs.commit_rest``); the scratch delta is committed at
    ``inputs.out.delta`` for the check. RebuildMismatch when they differ, SourceUnreadable
    when a contribution cannot be read."""
    base = open_base(inputs)
    try:
        tried = try_step(inputs, base, list(inputs.uploads), StageClock())
    finally:
        base.close()
    out = tried.out
    try:
        params_sha, delta_sha = out.commit_delta()
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
