"""The gateway's open-file limit, raised at start (R3).

Every sandbox may keep its bridge connections (`BridgeLimits.max_connections`),
its bridge listener and its runner socket open in the gateway, beside the
store, the HTTP server and the channels' connections. A soft limit of 1024
(a common default for services) lets a few dozen hostile sandboxes take every
descriptor, and then the gateway cannot open its own database or accept a
request. `raise_open_files` lifts the soft limit to the hard one (capped by
the kernel's `fs.nr_open`); it never lowers anything.
"""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger(__name__)

NR_OPEN = "/proc/sys/fs/nr_open"
FALLBACK_CEILING = 1 << 20


def _ceiling() -> int:
    try:
        with open(NR_OPEN, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return FALLBACK_CEILING


def raise_open_files() -> int:
    """Set the soft RLIMIT_NOFILE to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _ceiling() if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError) as exc:
            logger.warning("could not raise the open-file limit from %d: %s", soft, exc)
    if soft < 4096:
        logger.warning(
            "the gateway may open only %d files: every sandbox's bridge holds some, so "
            "raise the hard limit (`ulimit -Hn`, LimitNOFILE=, compose `ulimits`)",
            soft,
        )
    return soft
