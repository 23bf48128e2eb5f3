"""P4: the Discord attachment URLs, DNS answers, redirects and sizes the gateway accepts."""

from __future__ import annotations

import pytest

from policies.cdn import cdn_addresses, cdn_redirect, cdn_size, cdn_url

GOOD = "https://cdn.discordapp.com/attachments/1/2/a.png?ex=1&is=2&hm=3"


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        (GOOD, True),
        ("https://media.discordapp.net/attachments/1/2/a.png", True),
        ("https://CDN.DISCORDAPP.COM/attachments/1/2/a.png", True),  # a host has no case
        ("https://cdn.discordapp.com:443/attachments/1/2/a.png", True),
        ("https://cdn.discordapp.com/ephemeral-attachments/1/2/a.png", True),
        ("http://cdn.discordapp.com/attachments/1/2/a.png", False),
        ("ftp://cdn.discordapp.com/attachments/1/2/a.png", False),
        ("//cdn.discordapp.com/attachments/1/2/a.png", False),
        ("cdn.discordapp.com/attachments/1/2/a.png", False),
        ("https://cdn.discordapp.com.evil.example/attachments/1/2/a.png", False),
        ("https://evil.example/attachments/1/2/a.png", False),
        ("https://cdn.discordapp.com@evil.example/attachments/1/2/a.png", False),
        ("https://user:pw@cdn.discordapp.com/attachments/1/2/a.png", False),
        ("https://evil.example#@cdn.discordapp.com/attachments/1/2/a.png", False),
        ("https://cdn.discordapp.com./attachments/1/2/a.png", False),  # trailing dot
        ("https://cdn.discordapp.com:8443/attachments/1/2/a.png", False),
        ("https://cdn.discordapp.com:99999/attachments/1/2/a.png", False),
        ("https://cdn.discordapp.com/avatars/1/2.png", False),  # not an attachment
        ("https://cdn.discordapp.com\\@evil.example/attachments/1/2/a.png", False),
        ("https://cdn.discordapp.com/attachments/1/2/a b.png", False),
        ("https://cdn.discordapp.com/attachments/1/2/a.png\r\nHost: evil", False),
        ("https://127.0.0.1/attachments/1/2/a.png", False),
        ("https://[::1]/attachments/1/2/a.png", False),
        ("https://cdn.discordapp.com/attachments/" + "a" * 2100, False),
        ("", False),
    ],
)
def test_P4_url_table(url: str, allowed: bool) -> None:
    d = cdn_url(url)
    assert d.allowed is allowed, d.reason
    assert d.rule == "P4"


@pytest.mark.parametrize(
    ("addresses", "allowed"),
    [
        (["162.159.129.233"], True),
        (["162.159.129.233", "2606:4700::6810:84e5"], True),
        (["127.0.0.1"], False),
        (["169.254.169.254"], False),  # cloud metadata
        (["10.0.0.5"], False),
        (["172.16.0.1"], False),
        (["192.168.1.1"], False),
        (["100.64.0.1"], False),  # carrier-grade NAT
        (["0.0.0.0"], False),
        (["224.0.0.1"], False),
        (["::1"], False),
        (["fe80::1"], False),
        (["fc00::1"], False),
        (["::ffff:127.0.0.1"], False),  # IPv4-mapped
        (["::ffff:169.254.169.254"], False),
        (["64:ff9b::a9fe:a9fe"], False),  # NAT64 of 169.254.169.254
        (["2002:7f00:1::"], False),  # 6to4 of 127.0.0.1
        (["162.159.129.233", "127.0.0.1"], False),  # one bad address spoils the answer
        ([], False),
        (["not-an-ip"], False),
    ],
)
def test_P4_every_resolved_address_must_be_public(addresses: list[str], allowed: bool) -> None:
    d = cdn_addresses("cdn.discordapp.com", addresses)
    assert d.allowed is allowed, d.reason
    assert d.rule == "P4"


def test_P4_redirects_stay_on_the_same_cdn_host() -> None:
    same = "https://cdn.discordapp.com/attachments/9/9/b.png"
    assert cdn_redirect(GOOD, same)
    assert not cdn_redirect(GOOD, "https://media.discordapp.net/attachments/9/9/b.png")
    assert not cdn_redirect(GOOD, "https://evil.example/attachments/9/9/b.png")
    assert not cdn_redirect(GOOD, "http://cdn.discordapp.com/attachments/9/9/b.png")
    assert (
        "another host"
        in cdn_redirect(GOOD, "https://media.discordapp.net/attachments/9/9/b.png").reason
    )


def test_P4_size_cap() -> None:
    assert cdn_size(10, 10)
    assert not cdn_size(11, 10)
    assert "10 bytes" in cdn_size(11, 10).reason
