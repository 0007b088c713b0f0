"""Delivery-time pinning: the request goes to the checked address, named by its host."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from core.webhook_urls import Allowlist
from workers.callbacks.ssrf import RefusedDestination, UnresolvedHost, pin_callback_url

LOOPBACK_ALLOWED = Allowlist.parse(["127.0.0.0/8", "::1"])


def test_name_is_pinned_to_its_checked_address() -> None:
    target = asyncio.run(pin_callback_url("http://localhost:8123/hook?a=1", LOOPBACK_ALLOWED))
    assert target.address in {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    assert target.url.host == str(target.address)
    assert target.url.port == 8123 and target.url.raw_path == b"/hook?a=1"
    assert target.host_header == "localhost:8123"
    assert target.sni_hostname is None  # plain http


def test_https_names_keep_sni_for_certificate_checks() -> None:
    target = asyncio.run(pin_callback_url("https://localhost/hook", LOOPBACK_ALLOWED))
    assert target.sni_hostname == "localhost"
    assert target.request_extensions() == {"sni_hostname": "localhost"}
    literal = asyncio.run(pin_callback_url("https://127.0.0.1/hook", LOOPBACK_ALLOWED))
    assert literal.sni_hostname is None


def test_ipv6_literal_keeps_brackets() -> None:
    target = asyncio.run(pin_callback_url("http://[::1]:9000/x", LOOPBACK_ALLOWED))
    assert target.url.netloc == b"[::1]:9000"
    assert target.host_header == "[::1]:9000"


@pytest.mark.parametrize("url", ["http://localhost:8123/", "http://127.0.0.1/",
                                 "http://[::ffff:169.254.169.254]/", "ftp://example.com/"])
def test_refused_without_allowlist(url: str) -> None:
    with pytest.raises(RefusedDestination):
        asyncio.run(pin_callback_url(url, Allowlist.parse([])))


def test_resolution_failure_is_transient() -> None:
    with pytest.raises(UnresolvedHost):
        asyncio.run(pin_callback_url("https://no-such-host.invalid/", Allowlist.parse([])))
