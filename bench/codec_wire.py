"""Throughput of the int8 codec and the upload wire format, for a model of a given size.

    python bench/codec_wire.py [--params 10_000_000] [--chunk 1048576] [--repeat 3]

Prints MB/s (of encoded body bytes for the wire, of fp32 input for the codec) for:
int8 encode, int8 decode, wire encode (chunks produced), wire decode (chunks fed).
The server's upload ingest (issue 3) can be no faster than the wire decode figure.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from diloco.wire.codec import Int8Codec
from diloco.wire.contribution import ContributionDecoder, ContributionMeta, encode_contribution


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--params", type=int, default=10_000_000)
    p.add_argument("--tensors", type=int, default=20, help="split the parameters over N tensors")
    p.add_argument("--chunk", type=int, default=1 << 20)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()

    torch.manual_seed(0)
    per = args.params // args.tensors
    delta = {f"t{i}": torch.randn(per) * 1e-3 for i in range(args.tensors)}
    codec = Int8Codec()
    encoded = {n: codec.encode(t) for n, t in delta.items()}
    meta = ContributionMeta(run_id="bench", round=1, base_version=0, tokens=1, inner_steps=1,
                            loss=1.0, codec=codec.describe())  # fmt: skip
    chunks = list(encode_contribution(meta, encoded, chunk_size=args.chunk))
    body = sum(len(c) for c in chunks)
    fp32 = args.params * 4
    expected = {n: tuple(t.shape) for n, t in delta.items()}

    def decode() -> None:
        decoder = ContributionDecoder(expected, codec=codec.describe())
        for chunk in chunks:
            decoder.feed(chunk)
        decoder.finish()

    figures = {
        "int8 encode (fp32 in)": fp32 / best_of(args.repeat, lambda: [
            codec.encode(t) for t in delta.values()]),
        "int8 decode (fp32 out)": fp32 / best_of(args.repeat, lambda: [
            codec.decode(e) for e in encoded.values()]),
        "wire encode (body)": body / best_of(args.repeat, lambda: sum(
            len(c) for c in encode_contribution(meta, encoded, chunk_size=args.chunk))),
        "wire decode (body)": body / best_of(args.repeat, decode),
    }  # fmt: skip
    print(f"{args.params:,} parameters in {args.tensors} tensors; body {body / 1e6:.1f} MB, "
          f"chunks of {args.chunk:,} bytes, best of {args.repeat}")  # fmt: skip
    for name, rate in figures.items():
        print(f"  {name:<24} {rate / 1e6:>9,.0f} MB/s")


if __name__ == "__main__":
    main()
