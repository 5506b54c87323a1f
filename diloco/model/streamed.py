"""A model run with one module's own parameters in memory at a time, read from a version's
files as the forward reaches it and let go after: the server's evals of a version and the
close's judge of a step (``server.checkpoints.evals``), whose memory is then the largest
module's, not the model's (4 GB at a billion parameters).

The model is built on the meta device. Every module that owns parameters gets a hook before
its forward, which reads its parameters from the parameters file (and, for a step not yet
written, adds the delta's decoded change: ``diloco.wire.delta.DeltaFile``, the bits a
returning volunteer gets), and one after, which puts the meta ones back. A tied weight is
read under its one name wherever it is used. Buffers (a Llama's rotary frequencies) are
given CPU memory and rebuilt by ``tie_weights``. Every use reads the files again: made for
a forward or a few (``EVAL_BATCH`` windows each), not for training.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from diloco.config import ModelSection
from diloco.model.architectures import build_model
from diloco.model.gpt import LanguageModel
from diloco.wire.delta import DeltaFile
from diloco.wire.tensorfile import TensorFileReader


class StreamedVersion:
    """``model``: the architecture of ``section``, its parameters read from ``params`` (plus
    the delta in ``delta``, when given) module by module as it runs (module docstring)."""

    def __init__(self, section: ModelSection, params: Path, delta: Path | None = None) -> None:
        with torch.device("meta"):
            self.model: LanguageModel = build_model(section)
        for module in self.model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
        self.model.tie_weights()  # ties the meta weights; rebuilds the buffers' values
        named = dict(self.model.named_parameters())  # a tied weight once, under its name
        self._names = {id(p): n for n, p in named.items()}
        self._params = TensorFileReader(params)
        try:
            shapes = {n: tuple(p.shape) for n, p in named.items()}
            self._delta = None if delta is None else DeltaFile(delta, shapes)
        except BaseException:
            self._params.close()
            raise
        self._held: dict[nn.Module, dict[str, nn.Parameter]] = {}
        for module in self.model.modules():
            if next(module.parameters(recurse=False), None) is not None:
                module.register_forward_pre_hook(self._load)
                module.register_forward_hook(self._drop)

    def _load(self, module: nn.Module, args: Any) -> None:
        own = {name: p for name, p in module.named_parameters(recurse=False)}
        self._held[module] = own
        for name, meta in own.items():
            full = self._names[id(meta)]
            values = self._params.tensor(full)
            if values.dtype != torch.float32 or values.shape != meta.shape:
                raise ValueError(f"{self._params.path}: {full} is not {tuple(meta.shape)} fp32")
            if self._delta is not None:
                self._delta.apply(full, values.view(-1))
            module._parameters[name] = nn.Parameter(values, requires_grad=False)

    def _drop(self, module: nn.Module, args: Any, output: Any) -> None:
        module._parameters.update(self._held.pop(module))

    def close(self) -> None:
        self._params.close()
        if self._delta is not None:
            self._delta.close()

    def __enter__(self) -> StreamedVersion:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
