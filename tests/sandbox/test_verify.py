"""The pre-turn check, as a pure table: every engine-side setting is compared (R5, S2, S4)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from sandbox.mountplan import MountPlan
from sandbox.spec import (
    LABEL_APP,
    LABEL_GATEWAY,
    SandboxLimits,
    SandboxSpec,
    host_config,
    sandbox_name,
)
from sandbox.verify import ObservedContainer, limit_violations, violations


def _spec(**changes: Any) -> SandboxSpec:
    base = SandboxSpec(
        name=sandbox_name("app", "0123456789abcdef", gateway="gw1"),
        image="img",
        image_id="sha256:1",
        user="1000:1000",
        env={},
        networks=(),
        plan=MountPlan(()),
        limits=SandboxLimits(),
        app="app",
        agent="bot",
        conversation="c1",
        gateway="gw1",
    )
    return dataclasses.replace(base, **changes)


def _faithful(spec: SandboxSpec) -> ObservedContainer:
    """What the engine reports for a container created exactly to `spec`."""
    host = host_config(spec)
    return ObservedContainer(
        name=spec.name,
        id="c",
        image_id=spec.image_id,
        labels={**spec.labels(), "org.opencontainers.image.title": "from the image"},
        user=spec.user,
        mounts=(),
        tmpfs=tuple(sorted(host.tmpfs)),
        cap_add=(),
        cap_drop=("ALL",),
        privileged=False,
        readonly_rootfs=True,
        security_opt=host.security_opt,
        network_mode=host.network_mode,
        pid_mode="",
        ipc_mode="private",
        devices=0,
        runtime=spec.runtime or "runc",
        running=True,
        pids_limit=host.pids_limit,
        memory=host.memory,
        memory_swap=host.memory_swap,
        nano_cpus=host.nano_cpus,
        ulimits=tuple(reversed(host.ulimits)),  # order is not a difference
        tmpfs_options=dict(host.tmpfs),
        networks=tuple(spec.networks) or ("none",),
        apparmor_profile="docker-default",
        log_type="none",
        log_options={},
        cgroupns_mode="private",
    )


@pytest.mark.parametrize("runtime", [None, "runsc"])
def test_R5_faithful_container_has_no_violations(runtime: str | None) -> None:
    spec = _spec(runtime=runtime)
    assert violations(spec, _faithful(spec)) == []


def _tmp_without_nosuid_nodev(o: ObservedContainer) -> dict[str, Any]:
    loosened = {**o.tmpfs_options, "/tmp": o.tmpfs_options["/tmp"].replace(",nosuid,nodev", "")}
    return {"tmpfs_options": loosened}


def _tmp_missing(o: ObservedContainer) -> dict[str, Any]:
    return {"tmpfs_options": {t: v for t, v in o.tmpfs_options.items() if t != "/tmp"}}


# Each row: what an attacker (or `docker update`) changed, and the words the refusal names.
ROWS: list[tuple[str, Any, str]] = [
    ("pids", lambda o: {"pids_limit": 100_000}, "pids limit is 100000"),
    ("pids-unlimited", lambda o: {"pids_limit": None}, "pids limit is None"),
    ("memory", lambda o: {"memory": 4 << 30}, "memory limit is 4294967296"),
    ("swap", lambda o: {"memory_swap": -1}, "memory+swap limit is -1"),
    ("cpu", lambda o: {"nano_cpus": 0}, "CPU limit (NanoCpus) is 0"),
    ("nofile", lambda o: {"ulimits": (("core", 0, 0), ("nofile", 1 << 20, 1 << 20))}, "ulimits"),
    ("core", lambda o: {"ulimits": (("nofile", 1024, 1024),)}, "ulimits"),
    ("network", lambda o: {"network_mode": "host"}, "network mode is 'host'"),
    ("networks", lambda o: {"networks": ("none", "bridge")}, "attached networks"),
    (
        "seccomp",
        lambda o: {"security_opt": (*o.security_opt, "seccomp=unconfined")},
        "security options added: seccomp=unconfined",
    ),
    ("nnp", lambda o: {"security_opt": ()}, "security options missing: no-new-privileges"),
    ("apparmor", lambda o: {"apparmor_profile": "unconfined"}, "AppArmor profile is 'unconfined'"),
    ("log-driver", lambda o: {"log_type": "json-file"}, "log driver is 'json-file'"),
    ("log-options", lambda o: {"log_options": {"max-size": "1g"}}, "log options set"),
    ("cgroupns", lambda o: {"cgroupns_mode": "host"}, "cgroup namespace is 'host'"),
    ("tmpfs-options", _tmp_without_nosuid_nodev, "tmpfs at /tmp has options"),
    ("tmpfs-missing", _tmp_missing, "tmpfs at /tmp is missing"),
    (
        "gateway-label",
        lambda o: {"labels": {**o.labels, LABEL_GATEWAY: "someone-else"}},
        "label io.cellgate.gateway is 'someone-else'",
    ),
    (
        "app-label",
        lambda o: {"labels": {k: v for k, v in o.labels.items() if k != LABEL_APP}},
        "label io.cellgate.app is None",
    ),
    (
        "extra-label",
        lambda o: {"labels": {**o.labels, "io.cellgate.extra": "1"}},
        "unexpected label io.cellgate.extra",
    ),
]


@pytest.mark.parametrize(("field", "change", "named"), ROWS, ids=[r[0] for r in ROWS])
def test_R5_each_loosened_setting_is_refused_by_name(field: str, change: Any, named: str) -> None:
    spec = _spec()
    good = _faithful(spec)
    bad = dataclasses.replace(good, **change(good))
    found = limit_violations(spec, bad)
    assert len(found) == 1, found
    assert named in found[0], found
    assert found == [v for v in violations(spec, bad) if v in found]


def test_R5_docker_update_names_pids_and_memory() -> None:
    spec = _spec()
    bad = dataclasses.replace(
        _faithful(spec), pids_limit=100_000, memory=4 << 30, memory_swap=4 << 30
    )
    found = violations(spec, bad)
    assert [v.split(" is ")[0] for v in found] == [
        "pids limit",
        "memory limit",
        "memory+swap limit",
    ]


def test_R5_runsc_expects_nproc_and_host_thread_headroom() -> None:
    spec = _spec(runtime="runsc", limits=SandboxLimits(pids=64))
    host = host_config(spec)
    assert ("nproc", 64, 64) in host.ulimits and host.pids_limit > 64
    bad = dataclasses.replace(_faithful(spec), ulimits=host_config(_spec()).ulimits)
    assert [v for v in violations(spec, bad) if v.startswith("ulimits")]


def test_R5_host_config_is_in_the_spec_hash() -> None:
    """S5: a change of what the engine is asked for recreates the sandbox."""
    assert _spec().spec_hash() != _spec(networks=("net",)).spec_hash()
    assert _spec().spec_hash() != _spec(limits=SandboxLimits(tmp_bytes=1)).spec_hash()


def test_R1_name_keeps_its_shape_and_differs_by_gateway() -> None:
    a = sandbox_name("shop", "0123456789abcdef", gateway="gw-a")
    b = sandbox_name("shop", "0123456789abcdef", gateway="gw-b")
    assert a != b
    for name in (a, b):
        prefix, _, digest = name.rpartition("-")
        assert prefix == "shop-agent-c" and len(digest) == 16 and int(digest, 16) >= 0
    assert a == sandbox_name("shop", "0123456789abcdef", gateway="gw-a")


def test_R1_gateway_id_is_made_once_and_read_back(tmp_path: Path) -> None:
    from sandbox.gateway_id import (
        GATEWAY_ID_FILE,
        GatewayIdError,
        load_gateway_id,
        write_gateway_id,
    )

    state = tmp_path / "state"
    first = load_gateway_id(state)
    assert first == load_gateway_id(state) == (state / GATEWAY_ID_FILE).read_text().strip()
    assert [p.name for p in state.iterdir()] == [GATEWAY_ID_FILE]  # no temp file left
    other = tmp_path / "other"
    assert load_gateway_id(other) != first
    with pytest.raises(GatewayIdError):
        write_gateway_id(state, "not-the-same")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / GATEWAY_ID_FILE).write_text("../../etc\n")
    with pytest.raises(GatewayIdError):
        load_gateway_id(bad)
    link = tmp_path / "link"
    link.mkdir()
    (link / GATEWAY_ID_FILE).symlink_to(state / GATEWAY_ID_FILE)
    with pytest.raises(GatewayIdError):
        load_gateway_id(link)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    import os

    os.mkfifo(fifo / GATEWAY_ID_FILE)
    with pytest.raises(GatewayIdError):
        load_gateway_id(fifo)
