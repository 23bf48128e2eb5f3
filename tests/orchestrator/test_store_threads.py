"""P2: the threads a session opened, kept per session in the store."""

from __future__ import annotations

from pathlib import Path

from orchestrator.store import Store
from orchestrator.store.threads import OWN_THREADS_MAX


def test_P2_own_threads_are_per_session_durable_and_recorded_once(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        store.record_own_thread("s1", "t1", conversation="c1", parent_chat_id="chan")
        store.record_own_thread("s1", "t1", conversation="c1", parent_chat_id="chan")
        store.record_own_thread("s1", "t2", conversation="c1", parent_chat_id="chan")
        store.record_own_thread("s2", "t3", conversation="c2", parent_chat_id="other")
        assert store.own_threads("s1") == frozenset({"t1", "t2"})
        assert store.own_threads("s2") == frozenset({"t3"})
        assert store.own_threads("s3") == frozenset()
        assert store.own_thread_count("s1") == 2
    with Store.open(tmp_path) as again:  # a restart keeps them
        assert again.own_threads("s1") == frozenset({"t1", "t2"})


def test_P2_own_threads_are_bounded(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        for i in range(OWN_THREADS_MAX + 5):
            store.record_own_thread("s", f"t{i}", conversation="c", parent_chat_id="chan")
        assert len(store.own_threads("s")) == OWN_THREADS_MAX
