"""P6: a share is revoked only by the session that made it (or an admin key)."""

from __future__ import annotations

import pytest

from policies.shares import revoke_share


@pytest.mark.parametrize(
    ("owner", "caller", "admin", "allowed"),
    [
        ("s1", "s1", False, True),
        ("s1", "s2", False, False),
        ("s1", None, False, False),
        ("s1", "", False, False),
        ("", "", False, False),  # unknown owner and no session are not "the same"
        ("", "s1", False, False),
        ("s1", "S1", False, False),
        ("s1", "s2", True, True),  # the operator may withdraw any share
        ("s1", None, True, True),
    ],
)
def test_P6_revoke_share_table(owner: str, caller: str | None, admin: bool, allowed: bool) -> None:
    d = revoke_share(owner, caller, admin)
    assert (d.allowed, d.rule) == (allowed, "P6")


def test_P6_refusal_names_who_may_revoke() -> None:
    assert "only that session" in revoke_share("s1", "s2", False).reason
