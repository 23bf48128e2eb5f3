"""What restore accepts from a backup archive: a table of hostile members (issue 11)."""

from __future__ import annotations

import pytest

from policies.archive import ArchiveLimits, Kind, MemberFacts, member_allowed

SMALL = ArchiveLimits(max_members=10, max_member_bytes=100, max_total_bytes=150, max_depth=6)


def facts(
    name: str, kind: Kind = "file", size: int = 1, index: int = 0, before: int = 0
) -> MemberFacts:
    return MemberFacts(name, kind, size, index, before)


@pytest.mark.parametrize(
    ("member", "allowed"),
    [
        (facts("cellgate-backup.json"), True),
        (facts("workspace/chats/api-1-ab/MEMORY.md"), True),
        (facts("workspace/chats", "dir", 0), True),
        (facts("./store/rows.json"), True),
        (facts("/etc/passwd"), False),
        (facts("workspace/../../etc/cron.d/x"), False),
        (facts("../outside"), False),
        (facts("workspace/chats/x/link", "symlink", 0), False),
        (facts("workspace/chats/x/hard", "hardlink", 0), False),
        (facts("workspace/dev/sda", "device", 0), False),
        (facts("workspace/fifo", "fifo", 0), False),
        (facts("elsewhere/file"), False),
        (facts("workspace\\..\\x"), False),
        (facts("workspace/a\x00b"), False),
        (facts(""), False),
        (facts("workspace/big", size=101), False),
        (facts("workspace/fits", size=100, before=50), True),
        (facts("workspace/over-total", size=100, before=51), False),
        (facts("workspace/many", index=10), False),
        (facts("workspace/a/b/c/d/e/f"), False),
        (facts("workspace/a/b/c/d/e"), True),
    ],
)
def test_restore_member_table(member: MemberFacts, allowed: bool) -> None:
    decision = member_allowed(member, SMALL)
    assert decision.allowed is allowed, decision.reason
    if not allowed:
        assert decision.reason
