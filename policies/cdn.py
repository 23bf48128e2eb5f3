"""P4: which Discord attachment URLs the gateway fetches, from which addresses, how much.

`discord_download_attachment` is a door the sandbox holds: the gateway
fetches whatever URL the sandbox names. Four pure decisions keep it to
Discord's CDN (the caller gathers the facts: the URL, what DNS answered,
where a redirect points, how many bytes arrived):

- `cdn_url(url)`: https only, the host exactly `cdn.discordapp.com` or
  `media.discordapp.net` (no user info, no other port, no trailing dot, no
  `cdn.discordapp.com.evil.example`), an attachment path, a bounded length.
- `cdn_addresses(host, addresses)`: every address DNS gave for the host is a
  public unicast one; one private, loopback, link-local (169.254.169.254,
  the cloud metadata service), multicast, reserved or unspecified address
  refuses the whole answer. IPv4 carried inside IPv6 (mapped, 6to4, NAT64,
  Teredo) is judged as the IPv4 address it carries.
- `cdn_redirect(current, location)`: a redirect stays on the same CDN host.
- `cdn_size(received, cap)`: a file larger than the cap is refused (while
  streaming, and up front from Content-Length).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from policies.base import Decision, allow, deny

__all__ = [
    "CDN_HOSTS",
    "MAX_URL_CHARS",
    "cdn_addresses",
    "cdn_host",
    "cdn_redirect",
    "cdn_size",
    "cdn_url",
]

CDN_HOSTS = frozenset({"cdn.discordapp.com", "media.discordapp.net"})
MAX_URL_CHARS = 2048
_PATHS = ("/attachments/", "/ephemeral-attachments/")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def cdn_host(url: str) -> str | None:
    """The URL's CDN host when `cdn_url` allows it, else None."""
    return urlsplit(url).hostname if cdn_url(url) else None


def cdn_url(url: str) -> Decision:
    """P4: may the gateway fetch this URL for a sandbox?"""
    if len(url) > MAX_URL_CHARS:
        return deny("P4", f"the URL is {len(url)} characters long (at most {MAX_URL_CHARS})")
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F or c == "\\" for c in url):
        return deny("P4", "the URL holds spaces, control characters or backslashes")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return deny("P4", "the URL cannot be parsed")
    if parts.scheme != "https":
        return deny(
            "P4", f"only https:// Discord CDN URLs are fetched, not {parts.scheme or 'none'}://"
        )
    if "@" in parts.netloc or parts.username is not None:
        return deny("P4", "a URL with user information is not a Discord CDN URL")
    host = parts.hostname or ""
    if host not in CDN_HOSTS:
        return deny(
            "P4",
            f"host {host[:80]!r} is not Discord's CDN: only cdn.discordapp.com and "
            "media.discordapp.net are fetched",
        )
    if port not in (None, 443):
        return deny("P4", f"port {port} is not Discord's CDN port (443)")
    if not parts.path.startswith(_PATHS):
        return deny("P4", "only attachment URLs (/attachments/...) are fetched")
    return allow("P4", f"an https attachment URL on {host}")


def _carried_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _public(text: str) -> bool:
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _carried_v4(ip)
        if inner is not None:
            ip = inner
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


def cdn_addresses(host: str, addresses: Iterable[str]) -> Decision:
    """P4: may the gateway connect to `host` given every address DNS answered for it?"""
    got = list(addresses)
    if not got:
        return deny("P4", f"{host} did not resolve to any address")
    bad = [a for a in got if not _public(a)]
    if bad:
        return deny(
            "P4",
            f"{host} resolves to a private, loopback or link-local address "
            f"({', '.join(bad[:3])}); nothing was fetched",
        )
    return allow("P4", f"{host} resolves to public addresses only")


def cdn_redirect(current: str, location: str) -> Decision:
    """P4: may a redirect from `current` to `location` (absolute) be followed?"""
    target = cdn_url(location)
    if not target:
        return deny("P4", f"the CDN redirected elsewhere: {target.reason}")
    if urlsplit(location).hostname != urlsplit(current).hostname:
        return deny("P4", "the CDN redirected to another host; redirects stay on one host")
    return allow("P4", "a redirect on the same CDN host")


def cdn_size(received: int, cap: int) -> Decision:
    """P4/W6: is a download of `received` bytes (so far, or announced) within the cap?"""
    if received > cap:
        return deny("P4", f"the file is larger than the download cap of {cap} bytes")
    return allow("P4")
