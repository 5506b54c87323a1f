"""``diloco sample DIR --prompt TEXT``: text from an exported model directory, with our own
model code (``diloco.model.hf.read_hf_dir``) and the directory's ``tokenizer.json``: torch and
tokenizers, no transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from client.cli.account import Device
from client.cli.support import ExitStatus, fail


def sample(
    folder: Annotated[Path, typer.Argument(help="A directory `diloco run export` wrote.")],
    prompt: Annotated[str, typer.Option("--prompt", help="The text to continue.")] = "\n",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, max=100_000)] = 200,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, max=10.0)] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="0: no cut.")] = 50,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    device: Annotated[Device, typer.Option(help="Where to run the model.")] = Device.cpu,
) -> None:
    """Generate text from an exported model (temperature 0: greedy)."""
    import torch

    from client.training import DeviceError, resolve_device
    from diloco.model.architectures import build_model
    from diloco.model.hf import HFError, read_hf_dir
    from diloco.train import load_parameters

    try:
        from tokenizers import Tokenizer
    except ImportError:
        fail(
            "sampling needs the tokenizers library: pip install 'diloco-hub[data]'",
            ExitStatus.ERROR,
        )
    try:
        section, params = read_hf_dir(folder)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        dev = resolve_device(device.value)
    except (HFError, DeviceError) as err:
        fail(str(err), ExitStatus.DATA)
    except Exception as err:  # tokenizers raises a bare Exception for a missing or bad file
        fail(f"{folder / 'tokenizer.json'}: cannot be read ({err})", ExitStatus.DATA)
    eos = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("eos_token_id")
    model = build_model(section)
    load_parameters(model, params)
    model.to(dev).eval()
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids or (
        [eos] if eos is not None else [0]
    )
    gen = torch.Generator(device=dev).manual_seed(seed)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            context = torch.tensor([(ids + out)[-section.block_size :]], device=dev)
            logits = model(context)[0, -1].float()
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k > 0:
                    cut = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                    logits = logits.masked_fill(logits < cut, float("-inf"))
                nxt = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
            if nxt == eos:
                break
            out.append(nxt)
    typer.echo(prompt + tokenizer.decode(out, skip_special_tokens=True))
