"""Which callback URLs the service may POST to: http(s) to public addresses only.

A callback URL is user input that makes our servers send requests, so a host that
resolves into the operator's network (private, loopback, link-local, cloud metadata
addresses) is refused unless the operator allow-lists it (`webhook_allowlist`: host
names or CIDRs). The API checks at submission; the callback worker checks again against
the address it actually connects to, since DNS may answer differently later.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from core.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

ALLOWED_SCHEMES = ("http", "https")
MAX_URL_CHARS = 2048

# Instance metadata services (AWS, GCP, Azure, OpenStack: IPv4; AWS Nitro: IPv6). The v4
# one is link-local anyway; naming them gives the user a clearer reason.
METADATA_ADDRESSES = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)


@dataclass(frozen=True, slots=True)
class Allowlist:
    """Operator exceptions: exact host names (lower case) and address ranges."""

    hosts: frozenset[str]
    networks: tuple[IPNetwork, ...]

    @classmethod
    def parse(cls, entries: list[str]) -> Allowlist:
        """Split `webhook_allowlist` entries into host names and CIDRs (a bare IP is a /32)."""
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for entry in entries:
            text = entry.strip().lower()
            if not text:
                continue
            try:
                networks.append(ipaddress.ip_network(text.strip("[]"), strict=False))
            except ValueError:
                hosts.add(text.rstrip("."))
        return cls(hosts=frozenset(hosts), networks=tuple(networks))

    def allows_host(self, host: str) -> bool:
        """True when the host name itself is allow-listed."""
        return host.lower().rstrip(".") in self.hosts

    def allows_address(self, address: IPAddress) -> bool:
        """True when the address lies in an allow-listed range."""
        return any(address.version == net.version and address in net for net in self.networks)


def address_refusal(address: IPAddress) -> str | None:
    """Why a request must not go to this address, or None when it is public.

    >>> address_refusal(ipaddress.ip_address("10.1.2.3"))
    'private'
    """
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        # ::ffff:127.0.0.1 reaches 127.0.0.1.
        return address_refusal(address.ipv4_mapped)
    if address in METADATA_ADDRESSES:
        return "cloud metadata"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if address.is_unspecified:
        return "unspecified"
    if address.is_reserved:
        return "reserved"
    if address.is_private:
        return "private"
    if not address.is_global:
        # Shared (100.64.0.0/10), benchmarking, documentation ranges and the like.
        return "non-public"
    return None


def split_callback_url(url: str) -> tuple[SplitResult, str, int]:
    """Parse a callback URL into (parts, host, port); ValueError for anything not http(s)."""
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"callback_url is longer than {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"callback_url is not a valid URL: {e}") from e
    if parts.scheme not in ALLOWED_SCHEMES:
        raise ValueError("callback_url must be an http:// or https:// URL")
    host = parts.hostname
    if not host:
        raise ValueError("callback_url has no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("callback_url must not carry credentials; sign-in is by signature")
    return parts, host, port or (443 if parts.scheme == "https" else 80)


def resolve_host(host: str, port: int) -> list[IPAddress]:
    """Every address the host name resolves to (an IP literal resolves to itself)."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"callback_url host {host!r} does not resolve: {e}") from e
    addresses: list[IPAddress] = []
    for info in infos:
        # IPv6 sockaddr may carry a scope ("fe80::1%eth0"); the address is what counts.
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise ValueError(f"callback_url host {host!r} does not resolve")
    return addresses


def check_addresses(host: str, addresses: list[IPAddress], allowlist: Allowlist) -> None:
    """ValueError unless every address is public or the host or address is allow-listed."""
    if allowlist.allows_host(host):
        return
    for address in addresses:
        reason = address_refusal(address)
        if reason is not None and not allowlist.allows_address(address):
            raise ValueError(
                f"callback_url host {host!r} resolves to {address}, a {reason} address; "
                "callbacks go to public addresses only (operators may allow-list hosts "
                "or ranges with BATCHINFER_WEBHOOK_ALLOWLIST)"
            )


def validate_callback_url(url: str, settings: Settings) -> None:
    """Refuse (ValueError, naming the reason) a URL the callback worker must not call."""
    _, host, port = split_callback_url(url)
    allowlist = Allowlist.parse(settings.webhook_allowlist)
    if allowlist.allows_host(host):
        return
    check_addresses(host, resolve_host(host, port), allowlist)
