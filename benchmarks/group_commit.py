"""Group commit (D1, F3): a burst's durable store writes, fsynced on the turn lane or grouped.

    python benchmarks/group_commit.py [--conversations 64] [--rounds 6] [--dir DIR]

No engine needed. Each round opens a fresh state database in a temporary
directory under `--dir` (default: the system's temporary directory; point it
at the filesystem of your state dir, whose fsync is what this measures) and
lets `--conversations` tasks at once each make the two durable writes of a
turn that the outside learns of (an accepted message, then one more message
row for the reply's commit), through the real lanes:

- lane fsync (the baseline, how it was before): each write committed with
  `synchronous=FULL` on the turn lane, so the lane waits for every fsync;
- group commit (how it is): each write committed on the turn lane inside
  `Store.deferred_sync()`, then `Store.sync(ticket)` on the sync lane, one
  fsync shared by the commits made before it began.

Rounds alternate between the two. Printed per case: the burst's wall time and
its p99 per-conversation latency (medians over rounds), and how many WAL
fsyncs group commit made; then group / lane ratios. A lone fdatasync's time on
that filesystem is printed first: what one lane fsync costs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._setup import percentile
from cellgate.models import ConversationKey
from orchestrator.lane import in_lane, in_sync_lane
from orchestrator.store import Store
from orchestrator.store.walsync import SyncTicket, WalSync

LANE, GROUP = "lane fsync", "group commit"


def lone_fdatasync(where: Path, n: int = 100) -> float:
    """Median seconds of one fdatasync after a 4 KiB append, in `where`."""
    path = where / "fsync-probe"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
    times = []
    try:
        for _ in range(n):
            os.write(fd, b"\0" * 4096)
            t0 = time.perf_counter()
            os.fdatasync(fd)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(times)


async def one(store: Store, i: int, grouped: bool) -> float:
    key = ConversationKey("bench", "api", f"chat-{i}")
    t0 = time.perf_counter()
    for n in range(2):
        if grouped:

            def deferred(n: int = n) -> SyncTicket:
                with store.deferred_sync() as ticket:
                    store.accept_new(key, f"m{n}", sender="u", text="hello")
                return ticket

            ticket = await in_lane(deferred)
            await in_sync_lane(store.sync, ticket)
        else:
            await in_lane(store.accept_new, key, f"m{n}", sender="u", text="hello")
    return time.perf_counter() - t0


async def burst(store: Store, n: int, grouped: bool) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    latencies = await asyncio.gather(*(one(store, i, grouped) for i in range(n)))
    return time.perf_counter() - t0, list(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    syncs = [0]
    real = WalSync._fsync

    def counted(self: WalSync) -> None:
        syncs[0] += 1
        real(self)

    WalSync._fsync = counted  # type: ignore[method-assign]
    walls: dict[str, list[float]] = {LANE: [], GROUP: []}
    p99s: dict[str, list[float]] = {LANE: [], GROUP: []}
    group_syncs: list[int] = []
    with tempfile.TemporaryDirectory(prefix="cgbench-group-", dir=args.dir) as tmp:
        root = Path(tmp)
        fsync = lone_fdatasync(root)
        for r in range(args.rounds):
            for case in (LANE, GROUP) if r % 2 == 0 else (GROUP, LANE):
                with Store.open(Path(tempfile.mkdtemp(dir=root))) as store:
                    syncs[0] = 0
                    wall, lat = asyncio.run(burst(store, args.conversations, case == GROUP))
                    walls[case].append(wall)
                    p99s[case].append(percentile(lat, 0.99))
                    if case == GROUP:
                        group_syncs.append(syncs[0])
    n = args.conversations
    print(f"filesystem of {args.dir or tempfile.gettempdir()}: one fdatasync {fsync * 1e3:.2f} ms")
    print(f"{n} conversations at once, 2 durable writes each, {args.rounds} rounds (medians):")
    for case in (LANE, GROUP):
        wall, p99 = statistics.median(walls[case]), statistics.median(p99s[case])
        print(f"  {case:13s} burst {wall * 1e3:8.1f} ms   p99 {p99 * 1e3:8.1f} ms")
    print(f"  group commit: {statistics.median(group_syncs):.0f} WAL fsyncs for {2 * n} writes")
    ratio = statistics.median(walls[GROUP]) / statistics.median(walls[LANE])
    ratio99 = statistics.median(p99s[GROUP]) / statistics.median(p99s[LANE])
    print(f"ratios: group / lane  burst {ratio:5.2f}x   p99 {ratio99:5.2f}x")


if __name__ == "__main__":
    main()
