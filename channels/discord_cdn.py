"""Fetching a Discord attachment for a sandbox (P4, W6): Discord's CDN and nothing else.

    fetcher = CdnFetcher(max_bytes=25 * 2**20)
    got = await fetcher.fetch("https://cdn.discordapp.com/attachments/1/2/a.png?ex=..")

Every step asks `policies.cdn`: the URL (https, a CDN host, an attachment
path), then the host is resolved once and EVERY address checked (no private,
loopback or link-local one), and the connection goes to a checked address
(the URL's host only names the TLS server and the Host header): no second
lookup that could answer something else. Redirects are followed by hand, at
most three, each on the same CDN host. The body is streamed and refused as
soon as it passes the cap (and up front when Content-Length says so).
Proxies from the environment are ignored; no cookies are kept.

Test hook, never reachable from config: `resolver` replaces DNS (what a name
resolves to is the attacker's part, so the checks still run on its answer);
`pins` sends a CDN name to a fixed loopback address and port without DNS and
without the address check, and `ssl_context` trusts a test CA. Production
builds `CdnFetcher(max_bytes=...)` and gets the system resolver, no pins, and
the default trust store.
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

import aiohttp

from cellgate.errors import PolicyDenied
from channels.base import ChannelFailed
from policies import cdn
from policies.base import Decision

__all__ = ["CdnFetcher", "Downloaded", "Resolver", "system_resolver"]

Resolver = Callable[[str, int], Awaitable[list[str]]]
MAX_REDIRECTS = 3
_CHUNK = 64 * 1024
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True, slots=True)
class Downloaded:
    name: str
    data: bytes


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for `host` (once: the caller connects to one)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def file_name(url: str) -> str:
    """A plain file name for a download, from the URL's last path segment."""
    base = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    base = _SAFE_NAME.sub("_", base).lstrip(".")[:100]
    return base or "attachment"


def _denied(decision: Decision) -> PolicyDenied:
    return PolicyDenied(decision.rule, decision.reason)


class CdnFetcher:
    def __init__(
        self,
        *,
        max_bytes: int,
        resolver: Resolver = system_resolver,
        pins: Mapping[str, tuple[str, int]] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        timeout: float = 120.0,
    ) -> None:
        self.max_bytes = max_bytes
        self._resolver = resolver
        self._pins = MappingProxyType(dict(pins or {}))
        self._ssl = ssl_context or ssl.create_default_context()
        self._timeout = timeout

    async def fetch(self, url: str) -> Downloaded:
        """The file at `url`, or `PolicyDenied` (P4) / `ChannelFailed` (the CDN failed)."""
        decision = cdn.cdn_url(url)
        if not decision:
            raise _denied(decision)
        timeout = aiohttp.ClientTimeout(total=self._timeout, sock_connect=15.0)
        async with aiohttp.ClientSession(
            timeout=timeout,
            trust_env=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
        ) as session:
            current = url
            for _ in range(MAX_REDIRECTS + 1):
                location = await self._get(session, current)
                if isinstance(location, bytes):
                    return Downloaded(file_name(current), location)
                step = cdn.cdn_redirect(current, location)
                if not step:
                    raise _denied(step)
                current = location
        raise ChannelFailed("discord", f"more than {MAX_REDIRECTS} redirects")

    async def _addresses(self, host: str) -> list[tuple[str, int]]:
        pin = self._pins.get(host)
        if pin is not None:
            return [pin]
        try:
            found = await self._resolver(host, 443)
        except OSError as exc:
            raise ChannelFailed("discord", f"cannot resolve {host}: {exc}") from exc
        decision = cdn.cdn_addresses(host, found)
        if not decision:
            raise _denied(decision)
        return [(a, 443) for a in found]

    async def _get(self, session: aiohttp.ClientSession, url: str) -> bytes | str:
        """One GET: the body, or the absolute URL a redirect points to."""
        parts = urlsplit(url)
        host = parts.hostname
        assert host is not None
        last: Exception | None = None
        for address, port in await self._addresses(host):
            shown = f"[{address}]" if ":" in address else address
            direct = urlunsplit(("https", f"{shown}:{port}", parts.path, parts.query, ""))
            try:
                async with session.get(
                    direct,
                    headers={"Host": host, "Accept-Encoding": "identity"},
                    server_hostname=host,
                    ssl=self._ssl,
                    allow_redirects=False,
                ) as response:
                    return await self._read(url, response)
            except (TimeoutError, aiohttp.ClientConnectorError) as exc:
                last = exc
                continue
            except aiohttp.ClientError as exc:
                raise ChannelFailed("discord", f"the CDN failed: {exc}") from exc
        raise ChannelFailed("discord", f"cannot reach {host}: {last}")

    async def _read(self, url: str, response: aiohttp.ClientResponse) -> bytes | str:
        if response.status in (301, 302, 303, 307, 308):
            location = response.headers.get("Location", "")
            if not location:
                raise ChannelFailed("discord", "the CDN redirected without a Location")
            return urljoin(url, location)
        if response.status != 200:
            raise ChannelFailed("discord", f"the CDN answered {response.status}")
        announced = response.content_length
        if announced is not None:
            decision = cdn.cdn_size(announced, self.max_bytes)
            if not decision:
                raise _denied(decision)
        data = bytearray()
        async for chunk in response.content.iter_chunked(_CHUNK):
            data += chunk
            decision = cdn.cdn_size(len(data), self.max_bytes)
            if not decision:
                raise _denied(decision)
        return bytes(data)
