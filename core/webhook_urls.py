"""Which callback URLs the service may POST to: http(s) to public addresses only.

A callback URL is user input that makes our servers send requests, so a host that
resolves into the operator's network (private, loopback, link-local, cloud metadata
addresses) is refused unless the operator allow-lists it (`webhook_allowlist`: host
names or CIDRs). An IPv6 address that maps or tunnels to an IPv4 one (IPv4-mapped and
-compatible, 6to4, Teredo, NAT64) is judged by that IPv4 address too, and an IPv4
literal in any spelling the resolver reads (decimal, octal, hex, short) as the address
it is. The API checks at submission; the callback worker checks again against the
address it actually connects to, since DNS may answer differently later.
"""

from __future__ import annotations

import ipaddress
import re
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


# IPv6 prefixes whose last 32 bits are an IPv4 address that the traffic reaches.
_EMBEDDING_96 = {
    "IPv4-translated": ipaddress.IPv6Network("::ffff:0:0:0/96"),
    "IPv4-compatible": ipaddress.IPv6Network("::/96"),
    "NAT64": ipaddress.IPv6Network("64:ff9b::/96"),
}
# IPv6 ranges refused whatever Python's `ipaddress` of the day thinks of them.
_REFUSED_V6 = {
    "local-use NAT64": ipaddress.IPv6Network("64:ff9b:1::/48"),
    "site-local": ipaddress.IPv6Network("fec0::/10"),
    "private": ipaddress.IPv6Network("fc00::/7"),
    "Teredo": ipaddress.IPv6Network("2001::/32"),
}
# Host text that is an IPv4 address in the forms inet_aton reads (and so the resolver,
# and hence the HTTP client): 2130706433, 0x7f.1, 0177.0.0.1, 127.1.
_IPV4_LIKE = re.compile(r"[0-9a-fx.]+", re.IGNORECASE)


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


def embedded_ipv4(address: ipaddress.IPv6Address
                  ) -> tuple[str, ipaddress.IPv4Address] | None:
    """The IPv4 address an IPv6 address maps or tunnels to, with the form's name.

    Each of these reaches (or may reach, through a relay or translator on the path) the
    IPv4 address inside it: IPv4-mapped ::ffff:0:0/96, IPv4-translated ::ffff:0:0:0/96,
    IPv4-compatible ::/96, 6to4 2002::/16 (bits 16-47), Teredo 2001::/32 (the client's
    address, the last 32 bits inverted) and the NAT64 well-known prefix 64:ff9b::/96.

    >>> embedded_ipv4(ipaddress.IPv6Address("2002:7f00:1::"))
    ('6to4', IPv4Address('127.0.0.1'))
    """
    if address.ipv4_mapped is not None:
        return "IPv4-mapped", address.ipv4_mapped
    if address.teredo is not None:
        return "Teredo", address.teredo[1]
    if address.sixtofour is not None:
        return "6to4", address.sixtofour
    last_32 = ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
    for name, network in _EMBEDDING_96.items():
        if address in network and (name != "IPv4-compatible" or int(address) > 1):
            return name, last_32
    return None


def address_refusal(address: IPAddress) -> str | None:
    """Why a request must not go to this address, or None when it is public.

    >>> address_refusal(ipaddress.ip_address("10.1.2.3"))
    'private'
    >>> address_refusal(ipaddress.ip_address("2002:7f00:1::"))
    'loopback (6to4 for 127.0.0.1)'
    """
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        # ::ffff:127.0.0.1 is 127.0.0.1 on a dual-stack socket.
        return address_refusal(address.ipv4_mapped)
    if address in METADATA_ADDRESSES:
        return "cloud metadata"
    if isinstance(address, ipaddress.IPv6Address):
        embedded = embedded_ipv4(address)
        if embedded is not None:
            reason = address_refusal(embedded[1])
            if reason is not None:
                return f"{reason} ({embedded[0]} for {embedded[1]})"
        for name, network in _REFUSED_V6.items():
            if address in network:
                return name
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


def literal_address(host: str) -> IPAddress | None:
    """The address a host names literally, in any spelling the resolver accepts, or None.

    Brackets, an IPv6 zone (`%eth0`, `%25eth0`) and a trailing dot are dropped; IPv4 in
    decimal, octal, hex or short forms is read as inet_aton reads it, so that such a host
    is judged as the address it reaches, without asking DNS.
    """
    text = host.strip().removeprefix("[").removesuffix("]").split("%", 1)[0].rstrip(".")
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    if _IPV4_LIKE.fullmatch(text):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    return None


def resolve_host(host: str, port: int) -> list[IPAddress]:
    """Every address the host name resolves to (an IP literal, in any spelling, resolves
    to itself)."""
    literal = literal_address(host)
    if literal is not None:
        return [literal]
    if any(c.isspace() or ord(c) < 0x20 or c == "%" for c in host):
        raise ValueError(f"callback_url host {host!r} is not a host name")
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
