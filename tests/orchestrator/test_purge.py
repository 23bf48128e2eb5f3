"""L3: a purge deletes the app's data even while a gateway that serves it is making a
spare quota image there (F1: its refill runs until its config reload drops the app)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from orchestrator.app_ops import _purge_dir
from sandbox.quota import mountinfo

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")


def test_L3_F1_purge_retries_past_a_spare_mounted_under_it(tmp_path: Path) -> None:
    quota = tmp_path / "quota" / "agent-p"
    spare = quota / "spare-0123456789abcdef.mnt"
    spare.mkdir(parents=True)
    (quota / "spares.lock").touch()
    # what a refill leaves as the purge starts: a spare mounted under the dir
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(spare)], check=True)
    made = threading.Event()

    def refill() -> None:  # and one more file made while the delete runs
        time.sleep(0.05)
        (quota / "pending-fedcba9876543210.img").write_bytes(b"x")
        made.set()

    t = threading.Thread(target=refill)
    t.start()
    try:
        _purge_dir(quota)
    finally:
        t.join()
        subprocess.run(["umount", "-l", str(spare)], check=False, capture_output=True)
    assert made.is_set() and not quota.exists()
    assert not [e for e in mountinfo() if e.mount_point.startswith(str(tmp_path))]
