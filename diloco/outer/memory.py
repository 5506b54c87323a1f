"""How much memory one close of a round takes on the server, from the run config's shapes
alone: what run creation checks against the server's ``close_memory_share``
(``server.runs.service``) before it accepts a model."""

from __future__ import annotations

import math

from diloco.config import RunConfig
from diloco.model.architectures import mlp_width, parameter_shapes

# fp32 copies of the model alive at once at the peak of a close (diloco.outer.close,
# diloco.outer.chunked), counted from the code: the pass itself holds a few chunks, never the
# model; centered_clip keeps its clipped mean (1). The judge's eval of every step (and,
# after publishing, the full eval of any version: server.checkpoints.evals) holds one
# module's parameters at a time (diloco.model.streamed): the largest tensor, and its decoded
# change, counted on their own.
CLOSE_MODEL_COPIES = 1
EVAL_BATCH = 32  # validation windows per eval forward (diloco.train.evaluate), as a close runs it
# allocator slack and small tensors, plus the pass's chunk buffers (the uploads' share is
# diloco.outer.chunked.UPLOAD_BUFFER_BUDGET, the step's five fp32 chunks of 4 MiB)
CLOSE_OVERHEAD_BYTES = 160 << 20


def close_memory_bytes(cfg: RunConfig, *, val_bytes: int = 0) -> int:
    """An estimate of the peak memory one close of a round of this run takes, in bytes,
    computed from shapes alone (nothing of the model's size is allocated):

        1 x 4P                                  model copies (CLOSE_MODEL_COPIES, fp32)
      + 2 x 4L                                  the eval's largest tensor L and its change
      + 4 x 32 x block_size x (4 C + 2 F + 3 V) the eval forward (no grad): a block's
                                                activations (x, norm, attention in and out:
                                                ~4 C; the MLP's hidden width F twice), and
                                                the logits in float (x3)
      + 2 x val_bytes                           the validation tokens, read and copied
      + 160 MiB                                 chunk buffers, slack

    with P the parameter count, C the width, F the MLP's width (4 C for gpt, the SwiGLU
    width for llama) and V the vocabulary."""
    m = cfg.model
    sizes = [math.prod(shape) for shape in parameter_shapes(m).values()]  # meta device
    per_token = 4 * m.n_embd + 2 * mlp_width(m) + 3 * m.vocab
    activations = EVAL_BATCH * m.block_size * per_token
    models = CLOSE_MODEL_COPIES * 4 * sum(sizes) + 2 * 4 * max(sizes)
    return models + 4 * activations + 2 * val_bytes + CLOSE_OVERHEAD_BYTES
