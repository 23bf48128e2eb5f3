"""`image_link`: a line_image link is served only while every fact holds (P5, P6)."""

from __future__ import annotations

import dataclasses

import pytest

from policies.line_images import ImageLinkFacts, image_link

LIVE = ImageLinkFacts(
    signed=True, now=1000.0, expires=2000, share_found=True, share_revoked=False,
    session_live=True,
)  # fmt: skip


def test_P5_a_signed_unexpired_link_of_a_live_session_is_served() -> None:
    assert image_link(LIVE).allowed


@pytest.mark.parametrize(
    ("change", "rule", "why"),
    [
        ({"signed": False}, "P5", "no such image"),
        ({"share_found": False}, "P5", "no such image"),
        ({"now": 2000.5}, "P5", "expired"),
        ({"share_revoked": True}, "P6", "revoked"),
        ({"session_live": False}, "P5", "session"),
        ({"signed": False, "share_revoked": True}, "P5", "no such image"),  # tells a forger nothing
    ],
)
def test_P5_P6_each_missing_fact_refuses(change: dict[str, object], rule: str, why: str) -> None:
    d = image_link(dataclasses.replace(LIVE, **change))  # type: ignore[arg-type]
    assert not d.allowed and d.rule == rule and why in d.reason
