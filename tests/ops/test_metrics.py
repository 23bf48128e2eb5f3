"""O2: `/metrics` in the Prometheus text format, admin-only, after real turns on a real engine."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.metrics import Metrics
from tests.ops.conftest import TOOL, OpsGateway


def scrape(ops: OpsGateway) -> dict[str, list[tuple[dict[str, str], float]]]:
    r = httpx.get(
        f"{ops.url}/metrics", headers={"Authorization": f"Bearer {ops.admin_key}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(series: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lab, v in series.get(name, []) if labels.items() <= lab.items())


def test_o2_metrics_need_an_admin_key(ops: OpsGateway) -> None:
    assert httpx.get(f"{ops.url}/metrics", timeout=30).status_code == 401
    r = httpx.get(
        f"{ops.url}/metrics", headers={"Authorization": f"Bearer {ops.user_key}"}, timeout=30
    )
    assert r.status_code == 403


def test_o2_metrics_after_real_turns(ops: OpsGateway) -> None:
    secret_chat = "metrics-chat-7f3a"
    secret_text = "echo metrics-private-text-91c2"
    assert ops.say(secret_chat, secret_text).status_code == 200
    assert ops.say("metrics-other", "echo hi").status_code == 200
    # a refusal: the bridge refuses a reply into another chat (P1)
    r = ops.say(secret_chat, f'{TOOL} reply \'{{"text": "x", "chat_id": "elsewhere"}}\'')
    assert r.status_code == 200
    m = scrape(ops)
    assert value(m, "cellgate_turns_total", agent=ops.agent, channel="api", outcome="ok") >= 3
    assert value(m, "cellgate_sandboxes_live", agent=ops.agent) >= 2
    assert value(m, "cellgate_refusals_total", rule="P1", action="reply") >= 1
    for stage in ("sandbox_ensure", "harness"):
        assert value(m, "cellgate_turn_stage_seconds_count", agent=ops.agent, stage=stage) >= 3
    assert value(m, "cellgate_turn_queue_wait_seconds_count", agent=ops.agent) >= 3
    assert value(m, "cellgate_turn_seconds_sum", agent=ops.agent) > 0
    assert value(m, "cellgate_channel_deliveries_total", channel="api", outcome="ok") >= 3
    assert "cellgate_queue_depth" in m
    deadline = time.monotonic() + 10  # the watcher runs (its first wake-up is 0.5 s in)
    while value(scrape(ops), "cellgate_event_loop_lag_seconds_count") < 1:
        assert time.monotonic() < deadline, "the event-loop lag watcher never reported"
        time.sleep(0.1)
    # no chat id, message text or key in any label
    every_label = " ".join(
        f"{k}={v}" for samples in m.values() for labels, _ in samples for k, v in labels.items()
    )
    for needle in (secret_chat, "metrics-private-text", ops.admin_key, ops.user_key, "elsewhere"):
        assert needle not in every_label
    # O2: a refusal's action label is the route, never the path with its chat id in it
    r = httpx.post(
        f"{ops.url}/v1/keys",
        json={"name": "metrics-peer", "agents": [ops.agent]},
        headers={"Authorization": f"Bearer {ops.admin_key}"},
        timeout=30,
    )
    assert r.status_code in (200, 201), r.text
    peer = r.json()["secret"]
    for chat in (secret_chat, "metrics-other"):  # K4: both are bound to the first key
        r = httpx.post(
            f"{ops.url}/v1/agents/{ops.agent}/chats/{chat}/messages",
            json={"text": "mine?"},
            headers={"Authorization": f"Bearer {peer}"},
            timeout=30,
        )
        assert r.status_code == 403 and r.json()["error"]["rule"] == "K4", r.text
    k4 = [labels for labels, _ in scrape(ops)["cellgate_refusals_total"] if labels["rule"] == "K4"]
    assert [lab["action"] for lab in k4] == ["api POST /v1/agents/{agent}/chats/{chat_id}/messages"]
    # reaping counts: remove one live sandbox through the gateway's own path
    name = next(sb.name for sb in ops.gateway.store.sandboxes() if sb.agent == ops.agent)
    assert ops.on_loop(ops.gateway.sandboxes.evict(name)) is True
    after = scrape(ops)
    assert value(after, "cellgate_sandboxes_reaped_total", agent=ops.agent) >= 1
    assert (
        value(after, "cellgate_sandboxes_live", agent=ops.agent)
        == value(m, "cellgate_sandboxes_live", agent=ops.agent) - 1
    )


async def test_o2_event_loop_lag_is_measured(tmp_path: Path) -> None:
    metrics = Metrics(tmp_path / "none.sqlite3")
    task = asyncio.create_task(metrics.watch_loop(0.05))
    await asyncio.sleep(0.08)
    time.sleep(0.3)  # block the loop, as a synchronous call would
    await asyncio.sleep(0.1)
    task.cancel()
    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
    }
    assert samples["cellgate_event_loop_lag_seconds_count"] >= 1
    assert samples["cellgate_event_loop_lag_seconds_sum"] >= 0.2


async def test_o2_deliveries_retries_and_outcomes_through_a_real_turn_loop(tmp_path: Path) -> None:
    from cellgate.models import ConversationKey
    from orchestrator.store import Conversation, Message, MessageState, Reply, Store
    from orchestrator.turns import TurnAnswer, TurnLoop

    store = Store.open(tmp_path)
    metrics = Metrics(store.path)
    calls: list[str] = []

    async def answer(conv: Conversation, message: Message) -> TurnAnswer:
        if message.text == "boom":
            raise RuntimeError("harness crashed")
        return TurnAnswer(True, "hi")

    async def flaky_channel(conv: Conversation, reply: Reply) -> None:
        calls.append(reply.outbound_key)
        if len(calls) == 1:
            raise ConnectionError("the platform is away")

    loop = TurnLoop(
        store,
        metrics.turn(answer),
        metrics.delivery(flaky_channel),
        bound=2,
        retry_pause=0.05,
    )
    conv = store.upsert_conversation(ConversationKey("shop-bot", "telegram", "4242"))
    first, _ = store.accept_message(conv.id, "m1", sender="u1", text="hello")
    second, _ = store.accept_message(conv.id, "m2", sender="u1", text="boom")
    loop.wake(conv.id)
    for _ in range(200):
        states = [store.get_message(m.id).state for m in (first, second)]  # type: ignore[union-attr]
        if states == [MessageState.DELIVERED, MessageState.DELIVERED]:
            break
        await asyncio.sleep(0.05)
    await loop.close()
    samples = [
        (s.name, dict(s.labels), s.value)
        for f in text_string_to_metric_families(metrics.render().decode())
        for s in f.samples
    ]
    store.close()

    def get(name: str, **labels: str) -> float:
        return sum(v for n, lab, v in samples if n == name and labels.items() <= lab.items())

    assert get("cellgate_turns_total", agent="shop-bot", channel="telegram", outcome="ok") == 1
    # a crashed turn is answered with a reference (R6): counted as `error`, audited as R6
    assert get("cellgate_turns_total", agent="shop-bot", outcome="error") == 1
    assert get("cellgate_refusals_total", rule="R6", action="turn") == 1
    assert get("cellgate_channel_deliveries_total", channel="telegram", outcome="error") == 1
    assert get("cellgate_channel_deliveries_total", channel="telegram", outcome="ok") == 2
    assert get("cellgate_channel_delivery_retries_total", channel="telegram") == 1
    assert get("cellgate_queue_depth", state="accepted") == 0
    assert all("4242" not in v for _, lab, _ in samples for v in lab.values())
