"""Where a webhook may point: an ``http(s)`` URL with no credentials in it, whose host
resolves only to public addresses, unless the operator allows a network
(``DILOCO_WEBHOOK_ALLOW_NETWORKS``, e.g. ``127.0.0.0/8`` for a test receiver).

Refused by default: loopback, private (RFC 1918, unique local), link-local (169.254/16, the
cloud metadata address among them, and fe80::/10), carrier-grade NAT (100.64/10),
multicast, reserved and unspecified addresses, and IPv4 inside IPv6 that maps to any of
those. A name is resolved, and every address it resolves to must pass: a name with one
public and one private address is refused. The check runs when the webhook is set and
again before each delivery, whose connection then goes to the very addresses checked
(``PinnedResolver``): a DNS answer that changes between the check and the connection
cannot lead it elsewhere.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp.abc import AbstractResolver, ResolveResult

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_URL = 2048
CGNAT = ipaddress.ip_network("100.64.0.0/10")


class UnsafeAddress(ValueError):
    """A webhook URL that is malformed or would reach a network it may not."""


@dataclass(frozen=True)
class Target:
    """A webhook URL taken apart: what it connects to."""

    url: str
    host: str
    port: int


def parse(url: str) -> Target:
    """The URL's scheme, host and port, checked: http or https, a host, no user or
    password, no fragment, at most 2048 characters; else ``UnsafeAddress``."""
    if len(url) > MAX_URL:
        raise UnsafeAddress(f"a URL of at most {MAX_URL} characters")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise UnsafeAddress("no spaces or control characters in the URL")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise UnsafeAddress(f"not a URL: {err}") from None
    if parts.scheme not in ("http", "https"):
        raise UnsafeAddress("the URL's scheme must be http or https")
    if parts.username is not None or parts.password is not None:
        raise UnsafeAddress("no credentials in the URL (user:password@): use the signature")
    if not parts.hostname:
        raise UnsafeAddress("the URL names no host")
    if parts.fragment:
        raise UnsafeAddress("no #fragment in the URL")
    default = 443 if parts.scheme == "https" else 80
    return Target(url=url, host=parts.hostname, port=port or default)


def networks(spec: str) -> tuple[Network, ...]:
    """The operator's allowed networks from ``a.b.c.d/n,...`` (empty: none)."""
    return tuple(ipaddress.ip_network(p.strip()) for p in spec.split(",") if p.strip())


def forbidden(address: Address) -> str | None:
    """Why a webhook may not reach ``address`` (None: a public address)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return forbidden(address.ipv4_mapped)
    for why, hit in (
        ("loopback", address.is_loopback),
        ("unspecified", address.is_unspecified),
        ("link-local (the cloud metadata address is one)", address.is_link_local),
        ("multicast", address.is_multicast),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
        ("carrier-grade NAT", isinstance(address, ipaddress.IPv4Address) and address in CGNAT),
    ):
        if hit:
            return why
    return None


async def resolve(target: Target, allowed: tuple[Network, ...]) -> list[Address]:
    """Every address ``target``'s host resolves to, each checked; ``UnsafeAddress`` when
    one is not public and not in ``allowed``, or the name does not resolve."""
    try:
        literal: Address | None = ipaddress.ip_address(target.host)
    except ValueError:
        literal = None
    if literal is not None:
        found = [literal]
    else:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as err:
            raise UnsafeAddress(f"{target.host} does not resolve: {err}") from None
        found = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
    for address in found:
        why = forbidden(address)
        if why is not None and not any(address in net for net in allowed):
            raise UnsafeAddress(
                f"{target.host} resolves to {address}, a {why} address: webhooks may not "
                "reach the hub's own networks (the operator may allow one: "
                "DILOCO_WEBHOOK_ALLOW_NETWORKS)"
            )
    return found


class PinnedResolver(AbstractResolver):
    """aiohttp's resolver for one delivery: the host resolves to the addresses checked."""

    def __init__(self, host: str, addresses: list[Address]) -> None:
        self.host, self.addresses = host, addresses

    async def resolve(
        self, host: str, port: int = 0, family: Any = socket.AF_INET
    ) -> list[ResolveResult]:
        if host != self.host:
            raise OSError(f"{host} is not the checked host {self.host}")
        return [
            ResolveResult(
                hostname=host,
                host=str(a),
                port=port,
                family=socket.AF_INET6 if a.version == 6 else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST,
            )
            for a in self.addresses
        ]

    async def close(self) -> None:
        return None
