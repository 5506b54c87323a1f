"""One close: the server's (``server.rounds.outer_step.apply_outer_step`` over real
storage) and the simulator's (``diloco.simulate.server.RoundDesk.close``) are the same
code, and that code is ``torch.optim.SGD(nesterov=True)`` with an int8 delta and error
feedback."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diloco.checkpoint import MOMENTUM_PREFIX, RESIDUAL_PREFIX
from diloco.config import RunConfig, parse_config
from diloco.faults import FaultInjector
from diloco.model.architectures import build_model
from diloco.outer.close import CloseInputs, Upload, VersionPaths, close_round
from diloco.outer.robust import Source, robust_aggregate
from diloco.outer.scoring import Score, Windows
from diloco.simulate.server import SIM_RUN_ID, RoundDesk, Standings, open_round
from diloco.simulate.versions import Versions
from diloco.train import parameters_of
from diloco.wire.codec import Int8Codec, make_codec
from diloco.wire.contribution import ContributionMeta, encode_contribution
from diloco.wire.delta import DATA, SCALES
from diloco.wire.tensorfile import TensorFileReader
from server.checkpoints import evals
from server.checkpoints import service as checkpoints_service
from server.rounds.outer_step import StepInputs, Stored, apply_outer_step
from server.storage import keys as server_keys
from server.storage.base import LocalStorage
from tests.conftest import server_run_config
from tests.support.contribute import outer_reference

RUN = SIM_RUN_ID  # the simulator's uploads name this run in their headers


def config(**aggregation: object) -> RunConfig:
    raw = server_run_config() | {"name": "one-close", "aggregation": aggregation}
    raw["outer"] = {"lr": 0.7, "momentum": 0.9}
    return parse_config(raw)


def initial_params(cfg: RunConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in parameters_of(build_model(cfg.model)).items()}


def body(cfg: RunConfig, delta: dict[str, torch.Tensor], round: int) -> list[bytes]:
    """An upload of ``delta`` through the real codec and wire encoder."""
    codec = make_codec(cfg.compression.kind, cfg.compression.block_size)
    meta = ContributionMeta(
        run_id=RUN,
        round=round,
        base_version=round - 1,
        tokens=cfg.lease_tokens,
        inner_steps=cfg.inner.steps,
        loss=3.0,
        codec=codec.describe(),
    )
    return list(encode_contribution(meta, {n: codec.encode(t) for n, t in delta.items()}))


def honest_deltas(params: dict[str, torch.Tensor], n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    common = {k: 1e-2 * torch.randn(t.shape, generator=gen) for k, t in params.items()}
    return [
        {k: c + 2e-3 * torch.randn(c.shape, generator=gen) for k, c in common.items()}
        for _ in range(n)
    ]


def read(path: Path) -> dict[str, torch.Tensor]:
    with TensorFileReader(path) as f:
        return {name: f.tensor(name) for name in f.entries}


def assert_same_files(server: list[Path], simulator: VersionPaths) -> None:
    for mine, theirs in zip(
        server, (simulator.params, simulator.state, simulator.delta), strict=True
    ):
        a, b = read(mine), read(theirs)
        assert a.keys() == b.keys() and a, mine
        for name in a:
            assert torch.equal(a[name], b[name]), (mine.name, name)
        assert mine.read_bytes() == theirs.read_bytes(), mine.name  # metadata too


def test_the_server_and_the_simulator_close_the_same_uploads_to_the_same_version(tmp_path):
    # Prepare: a plain mean (so that a blown-up upload moves the step), a store holding
    # version 0 and the run's validation data, a simulator holding the same version 0
    cfg = config(method="mean", max_loss_ratio=1.5, judge_windows=4)
    params = initial_params(cfg)
    storage = LocalStorage(tmp_path / "store")
    checkpoints_service.write_initial(
        storage, run_id=RUN, params=params, hparams={"lr": 0.7, "momentum": 0.9, "nesterov": True}
    )
    val = storage.local_file(server_keys.val(RUN))
    val.parent.mkdir(parents=True, exist_ok=True)
    val.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1))
                    .to(torch.uint8).numpy().tobytes())  # fmt: skip
    versions = Versions(cfg, params, run_id=RUN)

    def judge(path: Path, delta: Path | None) -> float:  # the server's judge, on the run's data
        return evals.evaluate_file(
            storage, run_id=RUN, cfg=cfg, params_path=path,
            windows=cfg.aggregation.judge_windows, delta_path=delta,
        )  # fmt: skip

    history: list[float] = []
    standings = Standings()
    for index in (1, 2, 3):
        deltas = honest_deltas(params, 3, seed=index)
        if index == 2:  # one upload blown up 10^4 times: finite, taken, and ruinous
            deltas[1] = {k: t * 1e4 for k, t in deltas[1].items()}
        desk: RoundDesk = open_round(cfg, index, standings)
        stored = []
        for i, delta in enumerate(deltas):
            chunks = body(cfg, delta, index)
            admitted = desk.admit(f"c{index}-{i}", f"v{i}", chunks)
            assert not isinstance(admitted, Exception) and hasattr(admitted, "source")
            key = f"runs/{RUN}/contributions/{index}/{i}.bin"
            blob = storage.local_file(key)
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(b"".join(chunks))
            stored.append(
                Stored(admitted.source.id, key, admitted.source.weight, admitted.source.norm)
            )
        base = server_keys.version(RUN, index - 1)

        # Execute: the server's close, then the simulator's, on the same uploads
        seed, recent = versions.check_seed(index), list(versions.recent)
        inputs = StepInputs(
            RUN, index, cfg, base.params, base.state, stored, list(history), 1, seed, recent
        )
        result = apply_outer_step(storage, inputs, faults=FaultInjector())
        assert result.pending is not None
        result.pending.commit()  # the server's closer commits them after publishing
        stepped = desk.close(versions, evaluate=judge, history=list(history), quorum=1)

        # Assert: the same guard decision, bit for bit the same version files
        assert result.files is not None and stepped.rejected is None
        left_out = {i for i, code in result.exclusion_codes.items() if code == "guard"}
        assert left_out == set(stepped.left_out) == ({"c2-1"} if index == 2 else set())
        assert result.excluded == stepped.left_out
        assert result.judge_loss == stepped.judge_loss and result.judge_loss is not None
        assert result.shares == stepped.shares
        assert result.update_norm == stepped.update_norm
        assert result.checks == stepped.checks and len(result.checks) == len(deltas)
        keys = server_keys.version(RUN, index)
        server_files = [storage.local_file(k) for k in (keys.params, keys.state, keys.delta)]
        assert_same_files(server_files, versions.paths(index))
        history = [*history, *(s.norm for s in result.shares.values())]
    versions.cleanup()


# ---------------------------------------------------------------- the reference


def exact_sgd(
    base: dict[str, torch.Tensor], aggregates: list[dict], lrs: list[float], momentum: float
) -> dict[str, torch.Tensor]:
    """x: ``torch.optim.SGD(nesterov=True)`` on the parameters with each round's aggregate
    as the gradient, nothing quantised (the spec's definition of the outer step)."""
    x = {n: t.clone().requires_grad_(True) for n, t in base.items()}
    sgd = torch.optim.SGD(list(x.values()), lr=lrs[0], momentum=momentum, nesterov=True)
    for g, lr in zip(aggregates, lrs, strict=True):
        sgd.param_groups[0]["lr"] = lr
        for n, p in x.items():
            p.grad = g[n].clone()
        sgd.step()
    return {n: p.detach() for n, p in x.items()}


def test_the_close_is_torch_sgd_nesterov_with_an_int8_delta_for_several_rounds(tmp_path):
    # Prepare: five rounds of three uploads each, clipped mean (the default)
    cfg = config()
    params = initial_params(cfg)
    versions = Versions(cfg, params, run_id=RUN)
    shapes = {n: tuple(t.shape) for n, t in params.items()}
    codec = make_codec(cfg.compression.kind, cfg.compression.block_size).describe()
    aggregates, lrs, history = [], [], []
    standings = Standings()

    # Execute: the close, round after round; the in-memory aggregate of the same uploads
    for index in range(1, 6):
        uploads, sources = [], []
        for i, delta in enumerate(honest_deltas(params, 3, seed=10 + index)):
            chunks = body(cfg, delta, index)
            path = tmp_path / f"{index}-{i}.bin"
            path.write_bytes(b"".join(chunks))
            desk = open_round(cfg, index, standings)
            admitted = desk.admit(str(i), "v", chunks)
            assert hasattr(admitted, "source")
            uploads.append(Upload(str(i), path, admitted.source.weight, admitted.source.norm))
            sources.append(
                Source(str(i), admitted.source.weight, admitted.source.norm, lambda c=chunks: c)
            )
        aggregates.append(
            robust_aggregate(
                sources, shapes=shapes, codec=codec, policy=cfg.aggregation, history=history
            ).delta
        )
        lrs.append(cfg.outer.lr_at(index, cfg.rounds.max_rounds))
        inputs = CloseInputs(
            RUN, index, cfg, versions.latest.params, versions.latest.state, uploads,
            list(history), 1, versions.paths(index),
        )  # fmt: skip
        closed = close_round(inputs, evaluate=lambda p, d: 0.0, base_judge_loss=0.0)
        assert closed.committed and closed.pending is not None and not closed.excluded
        assert closed.pending.write().commit_rest() == closed.params_sha256
        versions.published(index, closed.judge_loss)
        history = [*history, *(u.norm for u in uploads)]

    # Assert: bit for bit the tests' reference (torch.optim.SGD stepping the residual, the
    # int8 delta publishing it), round after round; and θ + r is plain SGD's x
    want = None
    theta = params
    hyper = (0.0, cfg.outer.momentum, cfg.outer.nesterov)
    for g, lr in zip(aggregates, lrs, strict=True):
        want = outer_reference(theta, g, hyper=(lr, *hyper[1:]), codec=Int8Codec(256), state=want)
        theta = want.params
    assert want is not None
    x = exact_sgd(params, aggregates, lrs, cfg.outer.momentum)
    state = read(versions.latest.state)
    for n, t in read(versions.latest.params).items():
        assert torch.equal(t, want.params[n]), n
        assert torch.equal(state[MOMENTUM_PREFIX + n], want.momentum[n]), n
        assert torch.equal(state[RESIDUAL_PREFIX + n], want.residual[n]), n
        torch.testing.assert_close(t + want.residual[n], x[n], rtol=0, atol=1e-6)
    delta = read(versions.latest.delta)
    assert {DATA + n for n in params} | {SCALES + n for n in params} == delta.keys()
    assert json.loads(TensorFileReader(versions.latest.params).metadata["param_names"]) == list(
        params
    )
    versions.cleanup()


def test_the_close_takes_scores_taken_on_arrival_as_they_are(tmp_path):
    # Prepare: three honest uploads; two of them scored before the close (as the server
    # scores on arrival), one of those with a score that fails, and no lease windows for
    # any: the close can only use the stored scores (scoring one itself needs its windows)
    cfg = config()
    params = initial_params(cfg)
    versions = Versions(cfg, params, run_id=RUN)
    standings = Standings()
    passing = Score(own_gain=0.02, other_gain=0.01, own_base=5.5, other_base=5.5)
    failing = Score(own_gain=-1.0, other_gain=-1.0, own_base=5.5, other_base=5.5)
    stored = {"0": passing, "2": failing}
    uploads = []
    for i, delta in enumerate(honest_deltas(params, 3, seed=3)):
        chunks = body(cfg, delta, 1)
        path = tmp_path / f"{i}.bin"
        path.write_bytes(b"".join(chunks))
        admitted = open_round(cfg, 1, standings).admit(str(i), "v", chunks)
        assert hasattr(admitted, "source")
        w, norm = admitted.source.weight, admitted.source.norm
        uploads.append(Upload(str(i), path, w, norm, own=None, score=stored.get(str(i))))
    block = cfg.model.block_size
    tokens = torch.randint(0, 256, (cfg.aggregation.score_windows, block + 1))
    sample = Windows(tokens[:, :-1], tokens[:, 1:])
    inputs = CloseInputs(
        RUN, 1, cfg, versions.latest.params, versions.latest.state, uploads, [], 1,
        versions.paths(1), score_sample=sample,
    )  # fmt: skip

    # Execute
    closed = close_round(inputs, evaluate=lambda p, d: 0.0, base_judge_loss=0.0)

    # Assert: the failing score left its upload out, as a score the close took would; the
    # passing one's figures are its checks'; the unscored one (no windows) stays unscored
    assert closed.committed
    assert closed.exclusion_codes == {"2": "no_gain"}
    assert closed.excluded["2"] == failing.reason()
    assert (closed.checks["0"].own_gain, closed.checks["0"].other_gain) == (0.02, 0.01)
    assert closed.checks["1"].own_gain is None
    versions.cleanup()
