"""The inner loop: H AdamW steps on one worker, and evaluation.

A worker keeps its model and its AdamW state for as long as it stays in a run; at the
start of every round the model's parameters are overwritten with the global ones
(``load_parameters``) while the optimizer's moments carry over, as in DiLoCo.
The learning-rate schedule is indexed by the *global* inner step
(round index × H + local step), so a volunteer who joins late gets the lr the run is
at, not a fresh warmup.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from diloco.config import InnerSection
from diloco.data.text import eval_batches
from diloco.outer.memory import EVAL_BATCH
from diloco.precision import MixedPrecision, Precision, choose_precision
from diloco.wire.delta import apply_delta_file
from diloco.wire.tensorfile import TensorFileReader

Batch = tuple[torch.Tensor, torch.Tensor]


def lr_at(step: int, *, inner: InnerSection, total_steps: int) -> float:
    """Learning rate for global inner step ``step`` (0-based): linear warmup, then
    cosine decay to ``min_lr_ratio * lr`` at ``total_steps``, or constant."""
    if step < inner.warmup_steps:
        return inner.lr * (step + 1) / inner.warmup_steps
    if inner.schedule == "constant":
        return inner.lr
    span = max(1, total_steps - inner.warmup_steps)
    progress = min(1.0, (step - inner.warmup_steps) / span)
    floor = inner.lr * inner.min_lr_ratio
    return floor + 0.5 * (inner.lr - floor) * (1.0 + math.cos(math.pi * progress))


def parameters_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's trainable tensors by name (tied weights appear once)."""
    return dict(model.named_parameters())


@torch.no_grad()
def load_parameters(model: nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Copy ``params`` into the model in place, keeping optimizer references valid."""
    own = parameters_of(model)
    if own.keys() != params.keys():
        missing, extra = own.keys() - params.keys(), params.keys() - own.keys()
        raise KeyError(f"parameter names differ: missing {sorted(missing)}, extra {sorted(extra)}")
    for name, p in own.items():
        p.copy_(params[name])


@torch.no_grad()
def load_parameters_file(model: nn.Module, path: Path) -> None:
    """Read a version's parameters file (``diloco.checkpoint.write_params``' layout) into
    the model in place, tensor by tensor (straight into the model's memory on the CPU)."""
    with TensorFileReader(path) as f:
        for name, p in parameters_of(model).items():
            if p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous():
                f.read_into(name, 0, p.data.view(-1))
            else:
                p.copy_(f.tensor(name).view(p.shape))


@torch.no_grad()
def load_version_files(model: nn.Module, params: Path, delta: Path | None = None) -> None:
    """A version's parameters into the model: the parameters file, stepped by the delta
    file when one is given (θ + decode(q), ``diloco.wire.delta.apply_delta``: the bits a
    returning volunteer gets). The close's judge measures a step this way before the new
    parameters are written (``diloco.outer.close``)."""
    load_parameters_file(model, params)
    if delta is None:
        return
    own = parameters_of(model)
    flat = {n: p.detach().float().cpu().contiguous().view(-1) for n, p in own.items()}
    apply_delta_file(flat, delta)  # a tensor of the delta at a time
    for name, p in own.items():
        if p.data.view(-1).data_ptr() != flat[name].data_ptr():  # not the model's own memory
            p.copy_(flat[name].view(p.shape))


@torch.no_grad()
def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached fp32 copy of the parameters (θ at the start of a round)."""
    return {n: p.detach().float().clone() for n, p in parameters_of(model).items()}


def make_adamw(model: nn.Module, inner: InnerSection, *, fused: bool = False) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (embeddings and linear weights), as nanoGPT;
    ``fused`` (CUDA) updates every parameter in one kernel instead of a dozen per tensor."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": inner.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=inner.lr, betas=(inner.beta1, inner.beta2), fused=fused or None
    )


@dataclass
class InnerResult:
    steps: int
    tokens: int
    losses: list[float] = field(default_factory=list)

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses)


@dataclass(frozen=True)
class Ahead:
    """Steps a worker took ahead (``[inner] overlap``, issue 25): from ``guess``, its own end
    of the round it just uploaded, before the version its next lease names was known.
    ``counted``: their batches were new data, counted with the next lease's tokens (the
    simulator's diloco mode, whose workers read one stream each); a volunteer's were its
    last lease's data again, whose tokens that lease already counted."""

    guess: dict[str, torch.Tensor] = field(repr=False)
    result: InnerResult
    counted: bool = False


def train_ahead(
    trainer: InnerTrainer,
    steps: int,
    *,
    start_step: int,
    next_batch: Callable[[], Batch],
    counted: bool = False,
    stop_after: Callable[[int], bool] | None = None,
) -> Ahead:
    """Up to ``steps`` steps from where ``trainer``'s model is (its last round's end) as
    the start of its next lease (``start_lease``: the first moment reset as at any);
    ``stop_after(done)`` true ends them early (the next version has arrived)."""
    guess = snapshot(trainer.model)
    trainer.start_lease(guess)
    result = trainer.run(steps, start_step=start_step, next_batch=next_batch,
                         stop_after=stop_after)  # fmt: skip
    return Ahead(guess, result, counted)


class InnerTrainer:
    """One worker's model and AdamW, kept between rounds.

    ``precision`` (default: :func:`choose_precision` for the device) sets autocast and, for
    fp16, loss scaling. ``micro_batch`` (default: the whole batch) splits each step's batch
    into forward/backward passes of at most that many sequences whose gradients add up
    before the one AdamW step: the update is the full batch's (each part's loss weighted
    by its share of the rows), the memory that of a micro-batch.
    """

    def __init__(
        self,
        model: nn.Module,
        inner: InnerSection,
        *,
        total_steps: int,
        device: torch.device,
        precision: Precision | None = None,
        micro_batch: int | None = None,
    ) -> None:
        if micro_batch is not None and micro_batch < 1:
            raise ValueError(f"micro_batch must be at least 1, not {micro_batch}")
        self.model = model.to(device)
        self.inner = inner
        self.total_steps = total_steps
        self.device = device
        self.amp = MixedPrecision.for_device(device, precision or choose_precision(device))
        self.micro_batch = micro_batch
        self.optimizer = make_adamw(self.model, inner, fused=device.type == "cuda")
        self.skipped_steps = 0  # fp16 steps skipped because the gradients overflowed
        # the upload codec's error-feedback residual (int4, int2, sparse: diloco.wire.lowbit),
        # carried from one upload to the next; None: zeros (a new volunteer)
        self.error_feedback: dict[str, torch.Tensor] | None = None

    def start_lease(self, params: Mapping[str, torch.Tensor]) -> None:
        """Begin a lease's inner steps from θ(t−1) = ``params``: load them and, with
        ``[inner] reset_momentum``, zero AdamW's first moment. The second moment and the
        step count carry over, so no bias correction applies: the first moment rebuilds
        over the lease's first ~1 / (1 − beta1) steps, which are shorter for it. The client
        and the simulator's workers both start a lease here."""
        load_parameters(self.model, params)
        if self.inner.reset_momentum:
            for state in self.optimizer.state.values():
                if "exp_avg" in state:
                    state["exp_avg"].zero_()

    @torch.no_grad()
    def fold(self, base: Mapping[str, torch.Tensor], guess: Mapping[str, torch.Tensor]) -> None:
        """The real version lands after steps taken from a guess of it (overlap: issue 25):
        θ ← base + (θ − guess), in place. The steps' progress is kept on top of the version
        the lease names, and AdamW's state goes on untouched; the lease's Δ is then
        ``base − θ_end``, checked against ``base`` as any upload is."""
        for name, p in parameters_of(self.model).items():
            p.sub_(guess[name].to(p.device)).add_(base[name].to(p.device))

    def start_after(self, base: Mapping[str, torch.Tensor], ahead: Ahead | None) -> int:
        """Begin a lease from its version ``base``: ``start_lease``, or, after steps taken
        ahead (``train_ahead``), ``fold`` them onto it. The steps already taken (0 or
        ``ahead``'s): the lease's own count from there."""
        if ahead is None:
            self.start_lease(base)
            return 0
        self.fold(base, ahead.guess)
        return ahead.result.steps

    def accumulation(self, batch_size: int) -> int:
        """Forward/backward passes per step for a batch of ``batch_size`` sequences."""
        return -(-batch_size // min(self.micro_batch or batch_size, batch_size))

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Gradients of the batch's mean loss, accumulated over micro-batches; the loss."""
        rows = x.shape[0]
        micro = min(self.micro_batch or rows, rows)
        total = torch.zeros((), device=self.device)
        for xs, ys in zip(x.split(micro), y.split(micro), strict=True):
            with self.amp.autocast():
                loss = self.model(xs, ys)
            part = loss.float() * (xs.shape[0] / rows)  # this share of the batch's mean
            self.amp.backward(part)
            total += part.detach()
        return float(total)

    def run(
        self,
        steps: int,
        *,
        start_step: int,
        next_batch: Callable[[], Batch],
        on_step: Callable[[int, float], None] | None = None,
        stop_after: Callable[[int], bool] | None = None,
    ) -> InnerResult:
        """Take ``steps`` AdamW steps from global step ``start_step``; return tokens and losses.
        ``stop_after(done)``, asked after each step but the last, true ends the loop there:
        the result holds the ``done`` steps taken."""
        result = InnerResult(steps=steps, tokens=0)
        self.model.train()
        for i in range(steps):
            # set the lr of this global step
            lr = lr_at(start_step + i, inner=self.inner, total_steps=self.total_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            # forward + backward over micro-batches, under autocast
            x, y = next_batch()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            loss_value = self.forward_backward(x, y)
            # unscale (fp16), clip, step, clear
            self.amp.unscale(self.optimizer)
            if self.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip)
            if not self.amp.step(self.optimizer):
                self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            result.losses.append(loss_value)
            result.tokens += x.numel()
            if on_step is not None:
                on_step(i, loss_value)
            if stop_after is not None and i + 1 < steps and stop_after(i + 1):
                result.steps = i + 1
                break
        return result


@torch.no_grad()
def evaluate(
    model: nn.Module,
    val: torch.Tensor,
    *,
    block_size: int,
    batch_size: int = EVAL_BATCH,
    max_windows: int | None = None,
    device: torch.device | None = None,
) -> float:
    """Mean next-byte cross-entropy (nats) over non-overlapping validation windows."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in eval_batches(
        val, batch_size=batch_size, block_size=block_size, max_windows=max_windows
    ):
        loss = model(x.to(device), y.to(device))
        total += float(loss) * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count
