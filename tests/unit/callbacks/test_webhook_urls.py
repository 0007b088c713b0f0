"""Callback URL checks: schemes, address classes (IPv4 and IPv6), allow-list hosts and CIDRs."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from core.settings import Settings
from core.webhook_urls import Allowlist, address_refusal, validate_callback_url


def make_settings(tmp_path: Path, allowlist: list[str] | None = None) -> Settings:
    return Settings(data_dir=tmp_path, webhook_allowlist=allowlist or [])


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "cloud metadata"),
        ("169.254.1.1", "link-local"),
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "non-public"),
        ("192.0.2.10", "private"),
        ("::1", "loopback"),
        ("::", "unspecified"),
        ("fe80::1", "link-local"),
        ("fc00::1", "private"),
        ("fd12:3456::1", "private"),
        ("fd00:ec2::254", "cloud metadata"),
        ("ff02::1", "multicast"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:10.1.2.3", "private"),
        ("::ffff:169.254.169.254", "cloud metadata"),
    ],
)
def test_refused_addresses(address: str, reason: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) == reason


@pytest.mark.parametrize("address", ["93.184.215.14", "8.8.8.8", "1.1.1.1",
                                     "2606:4700:4700::1111", "2a00:1450:4001:80b::200e",
                                     "::ffff:8.8.8.8"])
def test_public_addresses_pass(address: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) is None


def test_allowlist_parses_hosts_cidrs_and_bare_ips() -> None:
    allowlist = Allowlist.parse(["Hooks.Internal.", "10.0.0.0/8", "127.0.0.1", "fd00::/8",
                                 "[::1]", " "])
    assert allowlist.allows_host("hooks.internal")
    assert not allowlist.allows_host("other.internal")
    assert allowlist.allows_address(ipaddress.ip_address("10.200.3.4"))
    assert allowlist.allows_address(ipaddress.ip_address("127.0.0.1"))
    assert not allowlist.allows_address(ipaddress.ip_address("127.0.0.2"))
    assert allowlist.allows_address(ipaddress.ip_address("fd12::7"))
    assert allowlist.allows_address(ipaddress.ip_address("::1"))
    assert not allowlist.allows_address(ipaddress.ip_address("fe80::1"))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://example.com/x", "http:// or https://"),
        ("file:///etc/passwd", "http:// or https://"),
        ("gopher://127.0.0.1:6379/_", "http:// or https://"),
        ("http:///nohost", "no host"),
        ("https://user:pw@example.com/", "credentials"),
        ("http://example.com:99999/", "not a valid URL"),
        ("http://127.0.0.1:8080/hook", "127.0.0.1, a loopback address"),
        ("http://10.1.2.3/hook", "a private address"),
        ("http://169.254.169.254/latest/meta-data", "cloud metadata"),
        ("http://[::1]:9000/", "loopback"),
        ("http://[fd00:ec2::254]/", "cloud metadata"),
        ("http://[::ffff:127.0.0.1]/", "loopback"),
        ("http://localhost:8000/", "loopback"),
        ("https://" + "a" * 2100 + ".com/", "longer than"),
    ],
)
def test_validate_refuses(tmp_path: Path, url: str, message: str) -> None:
    with pytest.raises(ValueError, match="callback_url") as info:
        validate_callback_url(url, make_settings(tmp_path))
    assert message in str(info.value)


def test_validate_accepts_public_literals(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    validate_callback_url("https://93.184.215.14/hook?x=1", settings)
    validate_callback_url("http://[2606:4700:4700::1111]:8443/", settings)


def test_allowlist_cidr_admits_private_addresses(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, ["127.0.0.0/8", "fd00::/8"])
    validate_callback_url("http://127.0.0.1:9999/hook", settings)
    validate_callback_url("http://localhost:9999/hook", settings)
    validate_callback_url("http://[fd00:ec2::254]/", settings)
    with pytest.raises(ValueError, match="private"):
        validate_callback_url("http://10.0.0.1/", settings)


def test_allowlist_host_admits_that_name_only(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, ["localhost"])
    validate_callback_url("http://localhost:9999/hook", settings)
    with pytest.raises(ValueError, match="loopback"):
        validate_callback_url("http://127.0.0.1:9999/hook", settings)


def test_unresolvable_host_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not resolve"):
        validate_callback_url("https://no-such-host.invalid/hook", make_settings(tmp_path))


def test_settings_read_allowlist_and_schedule_from_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHINFER_WEBHOOK_ALLOWLIST", "127.0.0.1, hooks.internal,10.0.0.0/8")
    monkeypatch.setenv("BATCHINFER_WEBHOOK_RETRY_SCHEDULE", "0.5,1,2")
    settings = Settings(data_dir=tmp_path)
    assert settings.webhook_allowlist == ["127.0.0.1", "hooks.internal", "10.0.0.0/8"]
    assert settings.webhook_retry_schedule == [0.5, 1.0, 2.0]
    monkeypatch.setenv("BATCHINFER_WEBHOOK_RETRY_SCHEDULE", "[1, 2]")
    assert Settings(data_dir=tmp_path).webhook_retry_schedule == [1.0, 2.0]


def test_settings_refuse_a_claim_shorter_than_the_timeout(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="webhook_claim_s"):
        Settings(data_dir=tmp_path, webhook_timeout_s=30, webhook_claim_s=10)
