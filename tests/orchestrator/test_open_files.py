"""R3: the gateway lifts its soft open-file limit to the hard one at start."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import resource
from orchestrator.open_files import raise_open_files
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
now = raise_open_files()
print(now, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
"""


def test_R3_the_soft_open_file_limit_is_raised_to_the_hard_one() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    now, soft, hard = (int(x) for x in out)
    assert now == soft > 256
    assert soft == hard or hard == -1  # RLIM_INFINITY: up to the kernel's nr_open
