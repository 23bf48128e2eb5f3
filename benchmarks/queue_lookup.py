"""A chat's turn queue, read in a chat with a long history (R4, F3).

    python benchmarks/queue_lookup.py [--history 50000] [--lookups 200]

No engine needed. Every admission check counts a chat's queue and every turn
reads it, on the turn lane that all chats share. One fresh state database in a
temporary directory holds a chat with `--history` answered messages (years of a
group chat, or a stranger's flood) and two waiting. Then, in the same run:

- without the index (the baseline, how it was before): the queue index
  `messages_queue` dropped, so SQLite reads the queue through the chat's
  history;
- with it (how it is): the partial index of pending messages.

Printed per case: the median time of `pending_for_conversation` and of
`pending_count`, and the with / without ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cellgate.models import ConversationKey
from orchestrator.store import Store


def median_ms(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, default=50_000)
    parser.add_argument("--lookups", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cg-bench-queue-") as tmp, Store.open(Path(tmp)) as st:
        conv = st.upsert_conversation(ConversationKey("bench", "telegram", "-100"))
        now = time.time()
        with st._db.write() as c:
            c.executemany(
                "INSERT INTO messages (conversation_id, platform_message_id, sender, text,"
                " received_at, state, updated_at) VALUES (?, ?, 's', ?, ?, 'delivered', ?)",
                [(conv.id, f"old-{i}", "x" * 200, now, now) for i in range(args.history)],
            )
        for i in range(2):
            st.accept_message(conv.id, f"new-{i}", sender="s", text="waiting")

        def measure() -> tuple[float, float]:
            assert len(st.pending_for_conversation(conv.id)) == 2
            return (
                median_ms(lambda: st.pending_for_conversation(conv.id), args.lookups),
                median_ms(lambda: st.pending_count(conv.id), args.lookups),
            )

        with_index = measure()
        with st._db.write() as c:
            c.execute("DROP INDEX messages_queue")
        without = measure()
    print(f"a chat of {args.history} answered messages and 2 waiting, {args.lookups} lookups")
    print(f"  {'case':<22}{'queue read ms':>15}{'queue count ms':>16}")
    print(f"  {'without the index':<22}{without[0]:>15.3f}{without[1]:>16.3f}")
    print(f"  {'messages_queue':<22}{with_index[0]:>15.3f}{with_index[1]:>16.3f}")
    print(
        f"  with / without: read {with_index[0] / without[0]:.4f}x,"
        f" count {with_index[1] / without[1]:.4f}x"
    )


if __name__ == "__main__":
    main()
