"""What a hostile volunteer can send: one function per attack, for the attack benchmark
(``bench/attacks.py``, in the simulator) and the tests that send the same bytes to a real
server. Each takes the honest work of the round and returns what the attacker uploads; the
``TRAINING`` ones change how the work is trained instead (the simulator and the tests
train them so), and send it as it came out.

Not a library for attacking anyone: every attack here is one that issues 11 and 26
measure against the server, and that the server must refuse, bound or find out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal, get_args

import torch

from diloco.wire.codec import EncodedTensor, make_codec
from diloco.wire.contribution import ContributionMeta, encode_contribution

Attack = Literal[
    "huge_scales",  # finite int8 scales so large that the decoded values overflow to Inf
    "scaled10",  # the honest Δ times 10
    "scaled100",  # ... times 100
    "sign_flip",  # −Δ: pulls the model back the way it came
    "noise",  # Gaussian noise with the honest Δ's norm: no signal at all
    "token_inflation",  # claims 10^12 tokens, to outweigh everyone (and earn their credit)
    "replay",  # uploads another volunteer's tensors as its own
    "stale",  # its Δ from an older version, relabelled as trained from the current one
    "zeros",  # an update of zeros: claims the lease's work, did none
    "copycat",  # another volunteer's Δ times 0.9: not byte-equal, so no replay
    "alie",  # "a little is enough": the honest mean minus one standard deviation per value
    "stale_base",  # trains its lease from the version before last, sends it as from the latest
    "other_data",  # trains as honestly, on other batches than its lease deals
]
# the freeloaders and direction attackers the close's checks leave out (diloco.outer.checks):
# they earn nothing
CHECKED: dict[Attack, str] = {
    "zeros": "zero_update",
    "copycat": "copy",
    "noise": "unaligned",
    "sign_flip": "opposed",
}
# attacks on how the work is trained, not on what is sent: the attacker uploads what it
# trained, encoded as any volunteer's
TRAINING: tuple[Attack, ...] = ("stale_base", "other_data")
# the freeloaders: work not done as leased (issue 26: detected within 3 rounds, no credit)
FREELOADERS: tuple[Attack, ...] = ("zeros", "noise", "copycat", "stale", *TRAINING)
ALIE_Z = 1.0
ATTACKS: tuple[Attack, ...] = get_args(Attack)
INFLATED_TOKENS = 10**12


def tamper_delta(
    attack: Attack,
    delta: Mapping[str, torch.Tensor],
    *,
    seed: int,
    peers: Sequence[Mapping[str, torch.Tensor]] = (),
) -> dict[str, torch.Tensor]:
    """The Δ an attacker sends in place of its honest ``delta`` (attacks on the values);
    ``peers``: the round's honest Δs it has seen (``alie``: all of them, its own with them)."""
    if attack == "zeros":
        return {n: torch.zeros_like(t) for n, t in delta.items()}
    if attack == "alie":  # Baruch et al. 2019: within the spread, every value pushed one way
        seen = [*peers, delta]
        stacked = {n: torch.stack([p[n] for p in seen]) for n in delta}
        return {n: s.mean(0) - ALIE_Z * s.std(0, correction=0) for n, s in stacked.items()}
    if attack == "scaled10":
        return {n: t * 10 for n, t in delta.items()}
    if attack == "scaled100":
        return {n: t * 100 for n, t in delta.items()}
    if attack == "sign_flip":
        return {n: -t for n, t in delta.items()}
    if attack == "noise":
        gen = torch.Generator().manual_seed(seed)
        noise = {n: torch.randn(t.shape, generator=gen) for n, t in delta.items()}
        scale = _norm(delta) / _norm(noise)
        return {n: t * scale for n, t in noise.items()}
    return dict(delta)


def _norm(tensors: Mapping[str, torch.Tensor]) -> float:
    return sum(float(t.double().pow(2).sum()) for t in tensors.values()) ** 0.5


def huge_scales(encoded: Mapping[str, EncodedTensor]) -> dict[str, EncodedTensor]:
    """Every int8 block at ±127 with the largest finite float32 scale: each frame passes the
    wire format's checks (finite, non-negative scales), and decodes to ±Inf."""
    out = {}
    for name, e in encoded.items():
        data = torch.where(e.data >= 0, 127, -127).to(torch.int8)
        scales = torch.full_like(e.scales, torch.finfo(torch.float32).max)
        out[name] = EncodedTensor(e.shape, data, scales)
    return out


def hostile_body(
    attack: Attack,
    delta: Mapping[str, torch.Tensor],
    meta: ContributionMeta,
    *,
    kind: str,
    block_size: int,
    seed: int = 0,
    other_delta: Mapping[str, torch.Tensor] | None = None,
    stale_delta: Mapping[str, torch.Tensor] | None = None,
    peers: Sequence[Mapping[str, torch.Tensor]] = (),
) -> bytes:
    """The whole upload body an attacker sends: ``delta`` and ``meta`` are its honest
    work's; ``other_delta`` another volunteer's Δ this round (``replay``, ``copycat``);
    ``stale_delta`` its own Δ from an earlier round (``stale``); ``peers`` the round's
    honest Δs (``alie``)."""
    if attack in ("replay", "copycat"):
        if other_delta is None:
            raise ValueError(f"{attack}: needs another volunteer's Δ")
        scale = 0.9 if attack == "copycat" else 1.0
        delta = {n: t * scale for n, t in other_delta.items()}
    elif attack == "stale":
        if stale_delta is None:
            raise ValueError("stale: needs an earlier round's Δ")
        delta = stale_delta
    else:
        delta = tamper_delta(attack, delta, seed=seed, peers=peers)
    codec_ = make_codec(kind, block_size)  # int8 or none: an attacker keeps no residual
    encoded = {n: codec_.encode(t) for n, t in delta.items()}
    codec = codec_.describe()
    if attack == "huge_scales":
        encoded = huge_scales(encoded)
    if attack == "token_inflation":
        meta = dataclasses.replace(meta, tokens=INFLATED_TOKENS)
    return b"".join(encode_contribution(dataclasses.replace(meta, codec=codec), encoded))
