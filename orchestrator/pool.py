"""The warm pool of one app agent (F1): hardened sandboxes started ahead, claimed once.

`WarmPool.claim(spec)` is asked by `ConversationSandboxes.ensure` before a cold
start. For a conversation it already served it verifies that conversation's
claimed sandbox (S4, R5: the engine's view against the pooled spec, and the
sandbox's own mount table against the plan by device and inode); for a new
conversation it takes a ready sandbox, binds the conversation's plan into its
slot (`sandbox.latebind`), verifies what the claim bound (both in the host
worker, `orchestrator.host_worker.CLAIMER`, F3), starts its runner, and hands
it over.
A claimed sandbox never returns to the pool: it serves one conversation and
is removed with it (the chat A / chat B rule). It answers None, and the
caller starts cold, when the pool is empty, the spec changed (the pool is
drained and refilled), the runtime or host cannot late-bind (said once in the
log), or the conversation already has a sandbox of its own.

`fill` runs in the background and keeps `size` ready, never more than `max`
per app and never beyond the gateway's sandbox cap (`room`, R4). Pooled
sandboxes carry this gateway's id (R1), so only it reaps them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from cellgate.errors import CellgateError, MountVerificationFailed
from orchestrator.agents import Agents
from orchestrator.bounded import LruMap
from orchestrator.config import PoolSettings
from orchestrator.host_worker import CLAIMER
from orchestrator.lane import in_host_lane
from orchestrator.resident import ResidentBackend
from orchestrator.sandboxes import ConversationSandboxes, limits_from, sandbox_env, sandbox_user
from orchestrator.spare_quota import SparedQuota
from sandbox.backends.base import SandboxHandle, SandboxNotFound
from sandbox.backends.docker import DockerBackend
from sandbox.backends.docker_pool import DockerPoolOps, engine_init, late_bind_refusal
from sandbox.latebind import LateBinder, LateBindError, Slot, bound_ahead, skeleton
from sandbox.mountplan import BRIDGE, MountPlan
from sandbox.pool import POOL_NAME_INFIX, pool_key, pooled_spec
from sandbox.spec import LABEL_APP, LABEL_GATEWAY, LABEL_MANAGED, SandboxSpec

logger = logging.getLogger(__name__)

COLD_MEMORY = 10_000
REFILL_INTERVAL = 30.0
REFILL_BATCH = 2
CLAIMS_AT_ONCE = 2  # claims sent to the host worker at once (F3)
REFILL_QUIET = 0.3  # seconds without a claim, and no claimed first turn running, before
STOP_SECONDS = 30.0  # how long `stop` waits for a pool's loop (a refill in flight) to end
REFILL_DEFER = 3.0  # the pool refills; but never put off longer than this

Room = Callable[[], Awaitable[int]]


@dataclass(eq=False, slots=True)
class Pooled:
    slot: Slot
    spec: SandboxSpec
    handle: SandboxHandle
    key: str
    trigger: int  # the slot's claim FIFO, held open: a byte ends the wait (its init, runner)

    def start_runner(self) -> bool:
        if self.trigger < 0:
            return False
        try:
            return os.write(self.trigger, b"\n") == 1
        except OSError:
            return False
        finally:
            self.close()

    def close(self) -> None:
        """Close the FIFO once (a second close could hit a descriptor reused meanwhile)."""
        fd, self.trigger = self.trigger, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass(frozen=True, slots=True)
class Claimed:
    pooled: Pooled
    plan: MountPlan


async def template_spec(sandboxes: ConversationSandboxes) -> SandboxSpec:
    """What every conversation spec of this agent shares, with no conversation and no plan."""
    image = await sandboxes.image()
    app = sandboxes.app
    return SandboxSpec(
        name="",
        image=app.image,
        image_id=image.id,
        user=sandbox_user(app.user, image.user),
        env=sandbox_env(image.env, app.environment),
        networks=app.networks,
        plan=MountPlan(()),
        limits=limits_from(sandboxes.settings),
        runtime=sandboxes.settings.runtime,
        app=app.name,
        agent=app.agent,
        conversation="",
        gateway=sandboxes.gateway_id,
    )


class WarmPool:
    def __init__(
        self,
        sandboxes: ConversationSandboxes,
        settings: PoolSettings,
        ops: DockerPoolOps,
        binder: LateBinder,
        *,
        room: Room | None = None,
        current: Callable[[], bool] = lambda: True,
        followed: Callable[[], bool] = lambda: False,
    ) -> None:
        self.sandboxes = sandboxes
        self.current = current  # False once its agent was restarted or dropped (L5)
        self.followed = followed  # True once a newer pool of its agent took over
        self.settings = settings
        self.ops = ops
        self.binder = binder
        self.room = room
        self.residents: ResidentBackend | None = None  # F2: started through the claim FIFO
        self.ready: collections.deque[Pooled] = collections.deque()
        self.claimed: dict[str, Claimed] = {}
        self.cold: LruMap[str, bool] = LruMap(COLD_MEMORY)
        self.wake = asyncio.Event()
        self._template: SandboxSpec | None = None
        self._key: str | None = None
        self._creating: set[str] = set()
        self._pending: dict[asyncio.Future[SandboxHandle], tuple[Slot, int, SandboxSpec]] = {}
        self._claiming: set[str] = set()
        self._claims = asyncio.Semaphore(CLAIMS_AT_ONCE)
        self._unsettled: set[str] = set()  # claimed, their first turn still running (F3)
        self._said: set[str] = set()
        self._last_plan: MountPlan | None = None  # the last claim's: what a slot makes
        # and binds ahead (F3) is worked out from it when the next slot is made
        self._last_claim = float("-inf")
        self._stop = threading.Event()  # ends a spare-quota refill in its worker thread
        self.stopped = False  # `stop`: it makes nothing more (its agent is being uninstalled)
        self._running = False
        self.ended = asyncio.Event()  # its background loop drained and ended
        self.refusal = late_bind_refusal(sandboxes.settings.runtime)
        if settings.size == 0:
            self.refusal = "the pool is off (pool.size is 0)"

    # -- claiming ------------------------------------------------------------

    async def claim(self, spec: SandboxSpec) -> SandboxHandle | None:
        """The verified pooled sandbox of `spec`'s conversation, or None: start cold."""
        if self.stopped:
            return None
        if self.refusal is not None:
            self._say_once("refused", "warm pool of %s off: %s", self.refusal)
            return None
        conv = spec.conversation
        mine = self.claimed.get(conv)
        if mine is not None:
            handle = await self._recheck(mine, spec)
            if handle is not None:
                return handle
        elif self.cold.get(conv):
            return None
        key = pool_key(spec)
        if key != self._key:
            await self._retemplate(spec, key)
            self.cold.put(conv, True)
            return None
        if mine is None and await self.ops.exists(spec.name):
            self.cold.put(conv, True)  # its own sandbox from before the pool: keep it
            return None
        # F3: a claim's binds and checks run in the host worker (`CLAIMER`), one after the
        # other; two sent at once keep it busy while the gateway takes an answer and sends
        # the next. More at once only bunch the claimed first turns on the event loop (its
        # lag p99 up to 21 ms with four, in bursts of 64; 7-13 ms with two).
        # The look-up above is an engine round trip with little Python: not in the queue.
        async with self._claims:
            while self.ready:
                pooled = self.ready.popleft()
                self._last_claim = asyncio.get_running_loop().time()
                self.wake.set()
                handle = await self._bind(pooled, spec)
                if handle is not None:
                    return handle
        self._say_once("empty", "warm pool of %s empty: new conversations start cold (%s)", "F1")
        self.cold.put(conv, True)
        return None

    async def _recheck(self, mine: Claimed, spec: SandboxSpec) -> SandboxHandle | None:
        pooled = mine.pooled
        if mine.plan != spec.plan:
            logger.info("sandbox %s: the plan changed; replacing it", pooled.handle.name)
            await self._retire(pooled)
            return None
        try:
            await self.ops.check(pooled.spec, pooled.handle, mine.plan)
        except SandboxNotFound:
            await self._retire(pooled)
            return None
        except MountVerificationFailed as exc:
            logger.warning("sandbox %s refused and removed: %s", pooled.handle.name, exc.violations)
            await self._retire(pooled)
            raise
        return pooled.handle

    async def _bind(self, pooled: Pooled, spec: SandboxSpec) -> SandboxHandle | None:
        self._claiming.add(pooled.slot.id)  # the sweep leaves a slot being claimed alone
        started = False
        bridge = spec.plan.by_target().get(str(BRIDGE))
        if self.residents is not None and bridge is not None:
            # an earlier sandbox's runner socket in this bridge dir would take the new runner
            await self.residents.close_bridge(Path(bridge.source))
        job = self.ops.claim_job(
            pooled.spec, pooled.handle, spec.plan, self.binder.root, pooled.slot
        )
        try:
            # bound and checked in the host worker (F3: the binds, the inspect and the
            # sandbox's mount table are Python work this process's lock need not do)
            found = await CLAIMER.claim(job, self.ops.claim_here)
            if found:
                raise MountVerificationFailed(pooled.handle.name, found)
            started = await in_host_lane(self._start_runner, pooled, spec.plan)
            self.claimed[spec.conversation] = Claimed(pooled, spec.plan)
            self._unsettled.add(spec.conversation)
            self._last_plan = spec.plan
        except (CellgateError, OSError) as exc:
            logger.warning("pooled sandbox %s not claimed: %s", pooled.handle.name, exc)
            self.claimed.pop(spec.conversation, None)
            await self._retire(pooled)
            return None
        finally:
            self._claiming.discard(pooled.slot.id)
        if self.residents is not None:
            self.residents.add_starter(pooled.handle.container_id, lambda: started)
        logger.info(
            "sandbox %s claimed from the pool",
            pooled.handle.name,
            extra={"conversation": spec.conversation},
        )
        return pooled.handle

    def _start_runner(self, pooled: Pooled, plan: MountPlan) -> bool:
        """The claim checked: (F2) bind the runner socket, then start the runner at once,
        so that its Python starts while the turn is prepared, and connects at its first
        try. Nothing is sent to it before the turn's sandbox is verified again (`ready`)."""
        bridge = plan.by_target().get(str(BRIDGE))
        if self.residents is None or bridge is None:
            pooled.start_runner()  # no runner: the claim still ends the wait (its init)
            return False
        try:  # listening before the runner starts: it connects at its first try
            self.residents.prebind(Path(bridge.source), pooled.handle.container_id)
        except OSError as exc:
            logger.warning("sandbox %s: runner socket not bound ahead: %s", pooled.handle.name, exc)
        return pooled.start_runner()

    def settled(self, conversation: str) -> None:
        self._unsettled.discard(conversation)

    async def _retire(self, pooled: Pooled) -> None:
        """Remove the sandbox and release its slot; it is never handed out again."""
        for conv, c in list(self.claimed.items()):
            if c.pooled is pooled:
                del self.claimed[conv]
                self._unsettled.discard(conv)
        pooled.close()
        if self.residents is not None and pooled.handle.container_id:
            self.residents.drop_prebound(pooled.handle.container_id)
        try:
            await self.sandboxes.backend.remove(pooled.handle.name)
        finally:
            await asyncio.to_thread(self.binder.release, pooled.slot)

    async def _retemplate(self, spec: SandboxSpec, key: str) -> None:
        if self._key is not None:
            logger.info("app %s's sandbox spec changed: draining its warm pool", spec.app)
        self._template = dataclasses.replace(spec, name="", conversation="", plan=MountPlan(()))
        self._key = key
        await self.drain()
        self.wake.set()

    # -- filling -------------------------------------------------------------

    async def fill(self, *, after_claims: bool = False) -> int:
        """Bring the pool up to `size` ready (within `max` and the gateway's cap); how many made.

        `after_claims` (the background task): a claim that came in while this got ready
        (past `_quiet`, before its first sandbox) makes it none now; its first turn goes
        first and the task comes back once it is over (F3)."""
        if self.refusal is not None or self.stopped:
            return 0
        if self._template is None:
            self._template = await template_spec(self.sandboxes)
            self._key = pool_key(self._template)
        try:
            await asyncio.to_thread(self.binder.setup)
        except (LateBindError, OSError) as exc:
            self.refusal = f"this host cannot late-bind mounts: {exc}"
            self._say_once("refused", "warm pool of %s off: %s", self.refusal)
            return 0
        want = min(self.settings.size, self.settings.max) - len(self.ready) - len(self._creating)
        if self.room is not None:
            room = await self.room()
            while room < 0 and self.ready:  # the cap came closer: give back pooled ones
                await self._retire(self.ready.pop())
                room += 1
            want = min(want, room)
        want = min(want, REFILL_BATCH)  # a refill never crowds out the turns of a burst (F3)
        if after_claims and (self._claiming or self._unsettled):
            return 0
        made = await asyncio.gather(*(self._make(self._template) for _ in range(max(0, want))))
        await self._refill_quota()
        return sum(made)

    async def _refill_quota(self) -> None:
        """Spare quota images, after the sandboxes (a first turn needs both).

        Cancelled (shutdown, restart), it tells the worker thread to stop and waits for
        the spare it is making: nothing is mounted under the state dir after `close`."""
        quota = self.sandboxes.quota
        if not isinstance(quota, SparedQuota) or not self.current() or self.stopped:
            return  # an agent gone, restarted or being uninstalled makes no spares
        agent, size = self.sandboxes.app.agent, self.settings.size
        job = asyncio.ensure_future(asyncio.to_thread(quota.refill, agent, size, self._stop))
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            self._stop.set()
            with contextlib.suppress(CellgateError, OSError):
                await job
            raise
        except CellgateError as exc:
            logger.warning("could not make spare quota images: %s", exc)

    def _new_slot(self, plan: MountPlan | None) -> Slot:
        """A new slot, with what the last claim's plan needed made and bound ahead (F3)."""
        if plan is None:
            return self.binder.new_slot((), ())
        return self.binder.new_slot(skeleton(plan), bound_ahead(plan))

    async def _make(self, template: SandboxSpec) -> bool:
        slot = await asyncio.to_thread(self._new_slot, self._last_plan)
        self._creating.add(slot.id)
        trigger = -1
        create: asyncio.Future[SandboxHandle] | None = None
        try:
            trigger = slot.open_trigger()
            spec = await asyncio.to_thread(pooled_spec, template, slot)
            # shielded: a drain meanwhile (shutdown, re-template) takes it over, waits
            # for it and removes what it made; the slot and trigger are then the drain's
            create = asyncio.ensure_future(self.ops.create(spec, own_init=self.binder.own_init))
            self._pending[create] = (slot, trigger, spec)
            handle = await asyncio.shield(create)
        except (CellgateError, OSError) as exc:
            logger.warning("could not start a pooled sandbox for %s: %s", template.app, exc)
            if create is None or self._pending.pop(create, None) is not None:
                if trigger >= 0:
                    os.close(trigger)
                await asyncio.to_thread(self.binder.release, slot)
            return False
        finally:
            self._creating.discard(slot.id)
        if self._pending.pop(create, None) is None:
            return False  # a drain took it over
        pooled = Pooled(slot, spec, handle, pool_key(template), trigger)
        if pooled.key != self._key:
            await self._retire(pooled)
            return False
        self.ready.append(pooled)
        return True

    async def drain(self) -> None:
        """Remove every ready sandbox, and every one still being made (claimed ones stay
        with their conversations)."""
        while self.ready:
            await self._retire(self.ready.pop())
        for create, (slot, trigger, spec) in list(self._pending.items()):
            self._pending.pop(create, None)
            try:
                handle = await create
            except (CellgateError, OSError):
                handle = None
            pooled = Pooled(slot, spec, handle or SandboxHandle(spec.name, "", ""), "", trigger)
            await self._retire(pooled)

    async def sweep(self) -> None:
        """Release slots whose sandbox is gone (removed by the reaper, evicted, spent)."""
        app = self.sandboxes.app.name
        labels = {LABEL_MANAGED: "1", LABEL_GATEWAY: self.sandboxes.gateway_id, LABEL_APP: app}
        names = {i.name for i in await self.sandboxes.backend.list(labels)}
        for conv, c in list(self.claimed.items()):
            if c.pooled.handle.name not in names:
                del self.claimed[conv]
                c.pooled.close()  # its claim FIFO's descriptor (open when the runner is off)
        self._unsettled &= self.claimed.keys()
        for p in list(self.ready):
            if p.handle.name not in names:
                self.ready.remove(p)
                p.close()
        held = {p.slot.id for p in self.ready} | {c.pooled.slot.id for c in self.claimed.values()}
        for slot_id in await asyncio.to_thread(self.binder.slot_ids):
            if slot_id in held or slot_id in self._creating or slot_id in self._claiming:
                continue
            if f"{app}{POOL_NAME_INFIX}{slot_id}" in names:
                continue
            await asyncio.to_thread(self.binder.release, Slot(self.binder.slots / slot_id))

    def holds(self, name: str) -> bool:
        """Is `name` a sandbox of this pool (ready, being made, being claimed or claimed)?"""
        prefix = f"{self.sandboxes.app.name}{POOL_NAME_INFIX}"
        if not name.startswith(prefix):
            return False
        slot_id = name[len(prefix) :]
        return (
            slot_id in self._creating
            or slot_id in self._claiming
            or any(p.slot.id == slot_id for p in self.ready)
            or any(c.pooled.slot.id == slot_id for c in self.claimed.values())
        )

    def conversation_of(self, name: str) -> str | None:
        """The conversation that claimed sandbox `name` (its label names none), or None."""
        for conv, c in self.claimed.items():
            if c.pooled.handle.name == name:
                return conv
        return None

    async def stop(self) -> None:
        """Make nothing more (no sandbox, no spare quota image: a refill in its worker
        thread ends before its next spare) and drain; returns once the background loop has
        ended (bounded), so that an uninstall removes and deletes with no refill under it."""
        self.stopped = True
        self._stop.set()
        self.wake.set()
        if not self._running:
            await self.drain()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_SECONDS):
                await self.ended.wait()

    async def run_forever(self, interval: float = REFILL_INTERVAL) -> None:
        """Refill after every claim (and every `interval`); drain when cancelled."""
        self._running = True
        try:
            while self.current() and not self.stopped:  # a restarted agent's old pool ends
                self.wake.clear()
                await self._quiet()
                try:
                    await self.sweep()
                    if await self.fill(after_claims=True):
                        self.wake.set()  # made some: go on with the next batch
                except CellgateError as exc:
                    logger.warning("warm pool of %s: %s", self.sandboxes.app.agent, exc)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval):
                        await self.wake.wait()
        finally:
            await asyncio.shield(self.drain())
            if not self.current() and not self.followed():
                await asyncio.shield(self._end())
            self.ended.set()

    async def _end(self) -> None:
        """The agent is gone or no longer pooled (uninstalled, stopped, made host-only):
        its claimed sandboxes were removed with it (S5), so their slots are released, and
        the stage and slot roots are unmounted. A pool that follows reuses them instead."""
        for c in list(self.claimed.values()):
            await self._retire(c.pooled)
        if self.followed():
            return
        # on the loop, not in a thread: no newer pool may set the roots up between
        # this check and the unmount (a few umount calls, once per uninstall)
        self.binder.teardown()
        quota = self.sandboxes.quota
        if isinstance(quota, SparedQuota):  # the spares it mounted (under their file lock)
            await asyncio.to_thread(quota.release_spares, self.sandboxes.app.agent)

    async def _quiet(self) -> None:
        """While claims come in and their first turns run, those turns go first (F3):
        refilling starts sandboxes and formats images on the same cores (a burst's last
        turns waited for a refill that began under them). At most `REFILL_DEFER` seconds
        of waiting."""
        loop = asyncio.get_running_loop()
        until = loop.time() + REFILL_DEFER
        while loop.time() < until and not self.stopped:
            calm = self._last_claim + REFILL_QUIET - loop.time()
            if calm <= 0 and not self._claiming and not self._unsettled:
                return
            await asyncio.sleep(max(calm, 0.05))

    def _say_once(self, what: str, message: str, arg: str) -> None:
        if what not in self._said:
            self._said.add(what)
            logger.warning(message, self.sandboxes.app.agent, arg)


class WarmPools:
    """The warm pools of a gateway's app agents, sharing its sandbox cap (R4).

    Empty when `pool.size` is 0 or the backend is not Docker. `room` counts the
    gateway's live sandboxes (`live`) and every pooled one against `max_sandboxes`.
    """

    def __init__(
        self,
        agents: Agents,
        settings: PoolSettings,
        backend: object,
        state_dir: Path,
        gateway_id: str,
        *,
        max_sandboxes: Callable[[], int],
        live: Callable[[], Awaitable[int]],
        residents: ResidentBackend | None = None,
    ) -> None:
        self.pools: list[WarmPool] = []
        self._max = max_sandboxes
        self._live = live
        self._agents = agents
        self._settings = settings
        self._residents = residents
        self.spawn: Callable[[WarmPool], None] | None = None  # runs a new pool (L5 restarts)
        self._on = settings.size > 0 and isinstance(backend, DockerBackend)
        if not self._on:
            return
        assert isinstance(backend, DockerBackend)
        self._root = state_dir / "pool" / gateway_id
        self._ops = DockerPoolOps(backend)
        for agent_id in list(agents):
            self._add(agent_id)

    def _add(self, agent_id: str) -> WarmPool | None:
        rt = self._agents.get(agent_id)
        sb = rt.sandboxes if rt is not None else None
        if not isinstance(sb, ConversationSandboxes):
            return None  # S6's one container and host agents have nothing to pool
        agents = self._agents

        def current() -> bool:
            now = agents.get(agent_id)
            return now is not None and now.sandboxes is sb

        # one slot root per agent: a pool's sweep releases slots it does not hold, so
        # two pools must never see each other's
        root = self._root / sb.app.agent
        runner = self._residents.runner_files(root) if self._residents is not None else None
        binder = LateBinder(root, runner, engine_init)
        pool = WarmPool(
            sb,
            self._settings,
            self._ops,
            binder,
            room=self.room,
            current=current,
            followed=lambda: self._followed(agent_id),
        )
        pool.residents = self._residents
        if sb.quota is not None and not isinstance(sb.quota, SparedQuota):
            sb.quota = SparedQuota(sb.quota, self._settings.size)
        sb.pool = pool
        self.pools.append(pool)
        return pool

    async def stop(self, agent_id: str) -> None:
        """An agent being uninstalled: its pools make nothing more, drain and end."""
        for p in [p for p in self.pools if p.sandboxes.app.agent == agent_id]:
            await p.stop()

    def restarted(self, agent_id: str) -> None:
        """L5: the agent was restarted (or dropped): its old pool drains now, not at its
        next refill; a restarted agent gets a pool of its own new sandboxes."""
        for old in [p for p in self.pools if not p.current()]:
            old._stop.set()  # a spare-quota refill in its worker thread makes no more
            old.wake.set()  # its loop sees it is no longer current, drains and ends
            self.pools.remove(old)
        self._follow(agent_id)

    def _followed(self, agent_id: str) -> bool:
        return any(p.current() and p.sandboxes.app.agent == agent_id for p in self.pools)

    def _follow(self, agent_id: str) -> None:
        """A pool for the agent as it runs now, unless it has one or is not pooled."""
        if not self._on or self._followed(agent_id):
            return
        rt = self._agents.get(agent_id)
        if rt is None or rt.unavailable is not None:
            return
        pool = self._add(agent_id)
        if pool is not None and self.spawn is not None:
            self.spawn(pool)

    def holds(self, name: str) -> bool:
        """Is `name` a sandbox one of this gateway's live pools holds (not an orphan)?"""
        return any(p.holds(name) for p in self.pools)

    def conversation_of(self, name: str) -> str | None:
        """The conversation that claimed pooled sandbox `name`, or None."""
        return next((c for p in self.pools if (c := p.conversation_of(name))), None)

    async def room(self) -> int:
        pooled = sum(len(p.ready) + len(p._creating) for p in self.pools)
        return self._max() - await self._live() - pooled

    async def fill(self) -> int:
        """Fill every pool once (what the background task does after each claim)."""
        made = 0
        for p in self.pools:
            made += await p.fill()
        return made

    async def drain(self) -> None:
        for p in self.pools:
            await p.drain()
