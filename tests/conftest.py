"""Suite-wide guards and fixtures.

- No test reaches past loopback: a connect to any other address fails the test.
- Tests that need Docker get `docker_client`; when CELLGATE_REQUIRE_DOCKER=1 (the
  test script sets it) a missing engine fails them instead of skipping.
- R1: when an engine answers, a FOREIGN gateway's sandboxes (cellgate labels, the
  app names the tests use, another gateway id) live through the whole session;
  the run fails if any test (or a gateway under test) removed one.
- Every quota image a test's gateway mounted (R2) under the test's tmp dirs is
  unmounted after it, and whatever is left under this session's tmp root at the end.
- The app images this run's gateways built (tagged `cellgate-app-<app>:<version>-<id>`,
  the id this run's or one derived from it) are removed at the end; no other image is.
"""

from __future__ import annotations

import gc
import ipaddress
import os
import secrets
import socket
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _check(address: Any) -> None:
    if isinstance(address, tuple) and address:
        host = str(address[0])
        if host in ("localhost", ""):
            return
        try:
            ip = ipaddress.ip_address(host.split("%")[0])
        except ValueError as exc:
            raise RuntimeError(f"test tried to reach {host!r}: tests stay on loopback") from exc
        if not ip.is_loopback:
            raise RuntimeError(f"test tried to reach {host}: tests stay on loopback")


def _guarded_connect(self: socket.socket, address: Any) -> None:
    _check(address)
    _real_connect(self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> int:
    _check(address)
    return _real_connect_ex(self, address)


@pytest.fixture(autouse=True, scope="session")
def _loopback_only() -> Iterator[None]:
    socket.socket.connect = _guarded_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = _guarded_connect_ex  # type: ignore[method-assign]
    yield
    socket.socket.connect = _real_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = _real_connect_ex  # type: ignore[method-assign]


@pytest.fixture(autouse=True, scope="session")
def _quota_mounts_released(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield
    if os.geteuid() == 0:
        from sandbox.quota import release_all

        release_all(tmp_path_factory.getbasetemp())


@pytest.fixture(autouse=True)
def _test_quota_mounts_released(request: pytest.FixtureRequest) -> Iterator[None]:
    used = "tmp_path" in request.fixturenames and os.geteuid() == 0
    tmp = request.getfixturevalue("tmp_path") if used else None
    yield
    if tmp is not None:
        from sandbox.quota import release_all

        release_all(tmp)


def require_docker() -> Any:
    import docker
    import docker.errors

    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        if os.environ.get("CELLGATE_REQUIRE_DOCKER") == "1":
            pytest.fail(f"a Docker engine is required here and none answers: {exc}")
        pytest.skip(f"no Docker engine: {exc}")
    return client


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    client = require_docker()
    yield client
    client.close()


@pytest.fixture(scope="session")
def base_image(docker_client: Any) -> str:
    """The base for test images: CELLGATE_BASE_IMAGE, else the local Debian base."""
    import docker.errors

    ref = os.environ.get("CELLGATE_BASE_IMAGE", "cellgate-base:bookworm")
    try:
        docker_client.images.get(ref)
    except docker.errors.ImageNotFound:
        pytest.fail(f"base image {ref} is missing: run `bash scripts/build-base-image.sh`")
    return ref


# The app names the suite's gateways serve; a foreign gateway serves the same ones.
GUARDED_APPS = (
    "e2e",
    "e2egv",
    "crash",
    "life",
    "cgbridge",
    "k1api",
    "appscli",
    "appsapi",
    "appsl5",
)


def _start_foreign(client: Any, image: str, gateway: str) -> dict[str, str]:
    from sandbox.spec import (
        LABEL_AGENT,
        LABEL_APP,
        LABEL_CONVERSATION,
        LABEL_GATEWAY,
        LABEL_MANAGED,
        sandbox_name,
    )

    made: dict[str, str] = {}
    for app in GUARDED_APPS:
        container = client.containers.run(
            image,
            ["sleep", "infinity"],
            name=sandbox_name(app, secrets.token_hex(8), gateway=gateway),
            labels={
                LABEL_MANAGED: "1",
                LABEL_APP: app,
                LABEL_AGENT: f"{app}-bot",
                LABEL_CONVERSATION: "foreign-conversation",
                LABEL_GATEWAY: gateway,
            },
            user="65532:65532",
            network_mode="none",
            cap_drop=["ALL"],
            read_only=True,
            log_config={"Type": "none", "Config": {}},
            detach=True,
        )
        made[container.name] = container.id
    return made


def _engine_or_none() -> Any:
    """A client of the engine that answers, or None. With no engine, the SDK's failed
    connection is collected here, out of the `except` (its traceback holds the socket),
    so no unrelated test (or the run's exit) fails on its ResourceWarning later."""
    import docker

    try:
        client = docker.from_env()
        client.ping()
    except Exception:
        client = None
    if client is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
    return client


@pytest.fixture(autouse=True, scope="session")
def _foreign_sandboxes_survive() -> Iterator[None]:
    """R1: another gateway's sandboxes on this engine are never touched by the suite."""
    import docker
    import docker.errors

    client = _engine_or_none()
    if client is None:
        yield
        return
    image = os.environ.get("CELLGATE_BASE_IMAGE", "cellgate-base:bookworm")
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        client.close()
        yield
        return
    made = _start_foreign(client, image, f"foreign-{secrets.token_hex(5)}")
    try:
        yield
    finally:
        gone = []
        for name, cid in made.items():
            try:
                client.api.inspect_container(cid)
            except docker.errors.NotFound:
                gone.append(name)
                continue
            client.api.remove_container(cid, force=True)
        client.close()
        if gone:
            pytest.fail(
                "R1: another gateway's sandboxes were removed during this run (by a test, a"
                " gateway under test, or an unscoped process on the same engine):"
                f" {', '.join(gone)}"
            )


def _run_image_tags(client: Any, run_id: str) -> list[str]:
    """This run's gateways' app image tags: the gateway id is the run's, or the run's
    with a suffix (a second gateway of the same test)."""
    import re

    from orchestrator.apps import BUILT_PREFIX

    own = re.compile(rf"{re.escape(BUILT_PREFIX)}[^:]+:[^:]*-{re.escape(run_id)}(-[A-Za-z0-9-]+)?")
    tags = []
    for image in client.api.images(name=f"{BUILT_PREFIX}*"):
        tags += [t for t in image.get("RepoTags") or () if own.fullmatch(t)]
    return tags


@pytest.fixture(autouse=True, scope="session")
def _run_images_removed() -> Iterator[None]:
    """Every app image a gateway of this run built is removed after the session (a run
    leaves no image behind on a machine that keeps its engine); an image still used by
    a container (another test's leak, which its own checks report) stays."""
    yield
    import docker
    import docker.errors

    from tests.support.run_id import RUN_ID

    client = _engine_or_none()
    if client is None:
        return
    try:
        for tag in _run_image_tags(client, RUN_ID):
            try:
                client.api.remove_image(tag)
            except docker.errors.APIError as exc:
                warnings.warn(f"image {tag} left in place: {exc.explanation}", stacklevel=1)
    finally:
        client.close()
