"""Every spelling of a private destination is refused, at submission and at delivery.

`http://[2002:7f00:1::]/` (6to4 for 127.0.0.1) and `http://[fec0::1]/` (site-local) once
passed both checks. The list below spells loopback, private, link-local and metadata
addresses in every IPv6 form that maps or tunnels to IPv4 (mapped, translated,
compatible, 6to4, Teredo, NAT64), IPv4 in decimal, octal, hex and short forms, with zone
ids, brackets and trailing dots; none may pass, with or without DNS.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable

import pytest

from core.settings import Settings
from core.webhook_urls import Allowlist, embedded_ipv4, validate_callback_url
from workers.callbacks.ssrf import RefusedDestination, pin_callback_url


def _teredo(client: str, server: str = "65.54.227.120") -> str:
    """A Teredo address for `client` (its last 32 bits are the client's inverted)."""
    high = int(ipaddress.IPv4Address(server)) << 64
    inverted = int(ipaddress.IPv4Address(client)) ^ 0xFFFF_FFFF
    return str(ipaddress.IPv6Address((0x2001_0000 << 96) | high | inverted))


def _6to4(v4: str) -> str:
    return str(ipaddress.IPv6Address((0x2002 << 112) | (int(ipaddress.IPv4Address(v4)) << 80)))


def _nat64(v4: str) -> str:
    return str(ipaddress.IPv6Address(int(ipaddress.IPv6Address("64:ff9b::"))
                                     | int(ipaddress.IPv4Address(v4))))


PRIVATE_V4 = ["127.0.0.1", "127.8.9.10", "10.0.0.1", "172.16.0.1", "192.168.1.1",
              "169.254.169.254", "169.254.1.1", "0.0.0.0", "100.64.0.1", "224.0.0.1",
              "255.255.255.255"]
V6_FORMS: dict[str, Callable[[str], str]] = {
    "mapped": lambda v4: f"::ffff:{v4}",
    "mapped-hex": lambda v4: str(ipaddress.IPv6Address(f"::ffff:{v4}")).replace(
        "::ffff:", "0:0:0:0:0:ffff:"),
    "translated": lambda v4: f"::ffff:0:{v4}",
    "compatible": lambda v4: f"::{v4}",
    "6to4": _6to4,
    "teredo": _teredo,
    "nat64": _nat64,
}
HOSTS = [f"[{form(v4)}]" for form in V6_FORMS.values() for v4 in PRIVATE_V4] + [
    # The two that passed, and ranges refused on their own.
    "[2002:7f00:1::]", "[fec0::1]", "[fec0:1:2::3]", "[feff::1]", "[fc00::1]",
    "[fd12:3456::1]", "[ff02::1]", "[ff05::2]", "[::]", "[::1]", "[0:0:0:0:0:0:0:1]",
    "[fe80::1]", "[fe80::1%25eth0]", "[fe80::1%25252f]", "[64:ff9b:1::a00:1]",
    "[2001:db8::1]", "[100::1]", "[fd00:ec2::254]",
    # IPv4 as the resolver reads it.
    "2130706433", "0x7f000001", "017700000001", "0x7f.1", "0177.0.0.1", "0177.1",
    "127.1", "127.0.1", "0x7f.0x0.0x0.0x1", "127.0.0.1.", "0.0.0.0", "0", "0x0",
    "167772161", "0xa.0.0.1", "012.0.0.1", "3232235777", "0xc0.0xa8.1.1",
    "2852039166", "0xa9.0xfe.0xa9.0xfe", "169.254.169.254.", "LOCALHOST",
]


@pytest.mark.parametrize("host", HOSTS)
def test_every_spelling_of_a_private_address_is_refused(host: str) -> None:
    url = f"http://{host}:8080/hook"
    with pytest.raises(ValueError):
        validate_callback_url(url, Settings(webhook_allowlist=[]))
    with pytest.raises(RefusedDestination):
        asyncio.run(pin_callback_url(url, Allowlist.parse([])))


@pytest.mark.parametrize("address", ["2002:7f00:1::", "::ffff:127.0.0.1",
                                     "64:ff9b::7f00:1", "::127.0.0.1", _teredo("127.0.0.1")])
def test_the_embedded_address_is_named(address: str) -> None:
    embedded = embedded_ipv4(ipaddress.IPv6Address(address))
    assert embedded is not None
    assert embedded[1] == ipaddress.IPv4Address("127.0.0.1")


@pytest.mark.parametrize("host", ["[2002:808:808::1]", "8.8.8.8", "[2606:4700::1111]",
                                  "134744072"])
def test_public_addresses_in_these_forms_still_pass(host: str) -> None:
    """6to4 of a public address and a public address in decimal are public."""
    target = asyncio.run(pin_callback_url(f"http://{host}/hook", Allowlist.parse([])))
    assert target.address.is_global
    validate_callback_url(f"http://{host}/hook", Settings(webhook_allowlist=[]))
