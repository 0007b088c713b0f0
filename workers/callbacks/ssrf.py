"""Delivery-time guard against server-side request forgery and DNS rebinding.

The API checked the callback URL at submission, but a name can resolve elsewhere by the
time we deliver. So each attempt resolves the host once, checks every address, and
connects to the checked address itself: the request URL carries that IP, while the Host
header and TLS SNI (hence certificate verification) carry the original name.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass

import httpx

from core.webhook_urls import (
    Allowlist,
    IPAddress,
    check_addresses,
    resolve_host,
    split_callback_url,
)


class RefusedDestination(ValueError):
    """The URL is not one we may call (bad scheme, private address); retrying won't help."""


class UnresolvedHost(OSError):
    """The host name did not resolve this time; a later attempt may succeed."""


@dataclass(frozen=True, slots=True)
class PinnedTarget:
    """Where one attempt connects: a checked address, and the name it stands for."""

    url: httpx.URL
    address: IPAddress
    host_header: str
    sni_hostname: str | None

    def request_extensions(self) -> dict[str, str]:
        """httpx request extensions that make TLS speak (and verify) the original name."""
        return {"sni_hostname": self.sni_hostname} if self.sni_hostname else {}


async def pin_callback_url(url: str, allowlist: Allowlist) -> PinnedTarget:
    """Resolve and check the URL's host now; the target to connect to for this attempt."""
    try:
        parts, host, port = split_callback_url(url)
        original = httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as e:
        raise RefusedDestination(str(e)) from e
    try:
        addresses = await asyncio.to_thread(resolve_host, host, port)
    except ValueError as e:
        raise UnresolvedHost(str(e)) from e
    try:
        check_addresses(host, addresses, allowlist)
    except ValueError as e:
        raise RefusedDestination(str(e)) from e
    address = addresses[0]
    # Certificates name hosts, not addresses: SNI only for https to a name (IDNA-encoded).
    needs_sni = parts.scheme == "https" and not is_ip_literal(host)
    return PinnedTarget(
        url=original.copy_with(host=str(address)),
        address=address,
        host_header=original.netloc.decode("ascii"),
        sni_hostname=original.raw_host.decode("ascii") if needs_sni else None,
    )


def is_ip_literal(host: str) -> bool:
    """True when the URL names an address rather than a host name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
