"""P4 with production settings: only the DNS answer is the test's (an attacker controls it).

`CdnFetcher(max_bytes=...)` is what the gateway builds: no pins, the default
trust store. Given a resolver that answers loopback or link-local addresses
for Discord's CDN names, it refuses before connecting anywhere. The pinned
fetcher (the e2e test hook) is exercised against the stand-in's TLS CDN.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cellgate.errors import PolicyDenied
from channels.base import ChannelFailed
from channels.discord_cdn import CdnFetcher, file_name
from tests.fakes.discord_standin import DiscordStandin

URL = "https://cdn.discordapp.com/attachments/1/2/a.png"


def answering(*addresses: str) -> object:
    asked: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append(host)
        return list(addresses)

    resolver.asked = asked  # type: ignore[attr-defined]
    return resolver


@pytest.mark.parametrize(
    "addresses",
    [("127.0.0.1",), ("169.254.169.254",), ("::1",), ("10.1.2.3",), ("8.8.8.8", "127.0.0.1")],
)
async def test_P4_production_fetcher_refuses_a_cdn_name_resolving_to_private(
    addresses: tuple[str, ...],
) -> None:
    resolver = answering(*addresses)
    fetcher = CdnFetcher(max_bytes=1024, resolver=resolver)  # type: ignore[arg-type]
    with pytest.raises(PolicyDenied) as err:
        await fetcher.fetch(URL)
    assert err.value.rule == "P4"
    assert addresses[-1] in err.value.reason
    assert resolver.asked == ["cdn.discordapp.com"]  # type: ignore[attr-defined]


async def test_P4_a_refused_url_is_never_resolved() -> None:
    resolver = answering("162.159.129.233")
    fetcher = CdnFetcher(max_bytes=1024, resolver=resolver)  # type: ignore[arg-type]
    for url in ("http://cdn.discordapp.com/attachments/1/2/a", "https://evil.example/x"):
        with pytest.raises(PolicyDenied):
            await fetcher.fetch(url)
    assert resolver.asked == []  # type: ignore[attr-defined]


@pytest.fixture
def dc() -> Iterator[DiscordStandin]:
    with DiscordStandin("t.o.k") as standin:
        yield standin


def pinned(dc: DiscordStandin, cap: int = 4096) -> CdnFetcher:
    return CdnFetcher(max_bytes=cap, pins=dc.cdn_pins, ssl_context=dc.client_ssl)


async def test_P4_the_pinned_test_fetcher_gets_a_cdn_file_and_follows_a_same_host_redirect(
    dc: DiscordStandin,
) -> None:
    url = dc.add_cdn_file(b"hello cdn", "hello.txt")
    got = await pinned(dc).fetch(url)
    assert (got.name, got.data) == ("hello.txt", b"hello cdn")
    moved = dc.add_cdn_redirect(url)
    again = await pinned(dc).fetch(moved)
    assert again.data == b"hello cdn"


async def test_P4_the_certificate_must_be_the_cdns(dc: DiscordStandin) -> None:
    """Without the test CA (the default trust store), the stand-in's certificate fails."""
    url = dc.add_cdn_file(b"x", "x.txt")
    fetcher = CdnFetcher(max_bytes=4096, pins=dc.cdn_pins)
    with pytest.raises(ChannelFailed):
        await fetcher.fetch(url)


async def test_P4_sizes_are_capped_while_streaming_and_up_front(dc: DiscordStandin) -> None:
    for url in (dc.add_cdn_stream(10_000, "s.bin"), dc.add_cdn_file(b"y" * 5000, "f.bin")):
        with pytest.raises(PolicyDenied, match="cap of 4096"):
            await pinned(dc).fetch(url)


def test_W6_a_download_gets_a_plain_file_name() -> None:
    assert file_name("https://cdn.discordapp.com/attachments/1/2/..%2F..%2Fetc") == "_.._etc"
    assert file_name("https://cdn.discordapp.com/attachments/1/2/") == "attachment"
    assert file_name("https://cdn.discordapp.com/attachments/1/2/a%20b.png?x=1") == "a_b.png"
