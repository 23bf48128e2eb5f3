"""Who may revoke a share (P6).

A share is revoked by the session that made it. An admin key may revoke any
share too: the operator must be able to withdraw a file that leaked, and an
admin key already reaches every conversation.
"""

from __future__ import annotations

from policies.base import Decision, allow, deny

__all__ = ["revoke_share"]


def revoke_share(
    share_owner_session: str, caller_session: str | None, caller_is_admin: bool
) -> Decision:
    """P6: may `caller_session` revoke a share made by `share_owner_session`?

    `caller_session` is None when the call comes from no session (e.g. a bare API key).
    """
    if caller_is_admin:
        return allow("P6", "an admin key may revoke any share")
    if not caller_session:
        return deny(
            "P6",
            "revoking a share needs the session that made it; this call comes from no session",
        )
    if not share_owner_session or caller_session != share_owner_session:
        return deny(
            "P6",
            "this share was made by another session; only that session (or an admin key) "
            "may revoke it",
        )
    return allow("P6", "the share was made by this session")
