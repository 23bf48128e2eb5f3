"""Whether a `line_image` link is still served (P5, P6).

LINE takes a picture only as a public URL, so `line_image` publishes a file
of the session's media directory by a link the gateway signs. The link is a
capability with a short life: it is served only while all of these hold.

- the signature is the channel's own for this share and expiry (a changed
  expiry or share id is not);
- it has not expired;
- the share is not revoked (P6: the session that made it may revoke it);
- the session that made it is still live: the link is revoked with it.

Pure: the caller reads the clock and the store and passes the facts.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Decision, allow, deny

__all__ = ["ImageLinkFacts", "image_link"]


@dataclass(frozen=True, slots=True)
class ImageLinkFacts:
    signed: bool
    now: float
    expires: int
    share_found: bool
    share_revoked: bool
    session_live: bool


def image_link(f: ImageLinkFacts) -> Decision:
    """P5/P6: may this `line_image` link be served now? Refusals name what ended it."""
    if not f.signed or not f.share_found:
        return deny("P5", "no such image")
    if f.now > f.expires:
        return deny("P5", "this image link has expired")
    if f.share_revoked:
        return deny("P6", "this image has been revoked")
    if not f.session_live:
        return deny("P5", "the session that published this image has ended")
    return allow("P5", "a live session's unexpired, unrevoked image")
