"""The start check of a container runtime (S2): the judge, and the probe on a real engine.

An old gVisor runs containers whose `ls` and `stat` fail ("Invalid argument"):
the judge must say so, and the probe must run in a hardened throwaway container
that never outlives the check.
"""

from __future__ import annotations

import secrets
import subprocess
from typing import Any

import pytest

from sandbox.backends.base import ExecResult
from sandbox.backends.docker import LABEL_PROBE, DockerBackend
from sandbox.runtime_check import (
    PROBE_STEPS,
    ProbeStep,
    check_runtime,
    judge,
    probe_script,
)

STEP = "@@cellgate-step"
DONE = "@@cellgate-done"
GOOD = (
    f"{STEP} 0 0\nbin\netc\nusr\n{STEP} 1 0\n/etc/hostname\n"
    f"{STEP} 2 0\ncellgate-runtime-probe\n{DONE}\n"
).encode()


def _result(stdout: bytes, code: int = 0, stderr: bytes = b"", timed_out: bool = False) -> Any:
    return ExecResult(code, stdout, stderr, timed_out)


# covers: S2 (the judge is a pure table)
@pytest.mark.parametrize(
    ("result", "failed", "detail"),
    [
        (
            _result(f"{STEP} 0 2\nls: cannot access '/': Invalid argument\n".encode(), 3),
            "`ls /` failed (exit 2)",
            "Invalid argument",
        ),
        (
            _result(
                f"{STEP} 0 0\netc\n{STEP} 1 1\nstat: cannot statx '/etc/hostname': "
                "Invalid argument\n".encode(),
                3,
            ),
            "`stat -c %n /etc/hostname` failed (exit 1)",
            "cannot statx",
        ),
        (
            _result(f"{STEP} 0 127\nsh: 1: ls: not found\n".encode(), 3),
            "`ls /`",
            "the image has no such command",
        ),
        (
            _result(f"{STEP} 0 0\nproc\nsys\n{STEP} 1 0\n/etc/hostname\n".encode(), 3),
            "`ls /`",
            "not 'etc'",
        ),
        (
            _result(f"{STEP} 0 0\netc\n{STEP} 1 0\n/etc/hostname\n{STEP} 2 0\n\n".encode(), 3),
            f"`{PROBE_STEPS[2].command}`",
            "not 'cellgate-runtime-probe'",
        ),
        (_result(b"", 1, b"exec format error"), "`ls /`", "exited 1: exec format error"),
        (_result(GOOD, 139), "the probe container", "exited 139 after its steps"),
        (_result(GOOD.replace(DONE.encode(), b""), 0), "the probe container", "exited 0"),
        (_result(GOOD[:40], -1, timed_out=True), "the probe container", "did not finish"),
    ],
)
def test_S2_judge_names_the_step_that_failed(result: ExecResult, failed: str, detail: str) -> None:
    verdict = judge("runsc", result)
    assert not verdict.ok
    assert verdict.failed == failed
    assert detail in verdict.detail
    assert verdict.message.startswith(f"runtime runsc: {failed}: ")
    assert "scripts/setup-engine.sh" in verdict.message
    assert failed in verdict.summary and verdict.detail not in verdict.summary


def test_S2_judge_accepts_a_working_runtime() -> None:
    assert judge("runc", _result(GOOD)).ok
    assert judge(None, _result(GOOD)).label == "default"


def test_S2_probe_script_passes_on_this_host_and_fails_a_broken_step() -> None:
    """The script itself is sound: run by the host's sh it passes; a failing step stops it."""
    argv = probe_script()
    done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
    assert judge(None, _result(done.stdout, done.returncode, done.stderr)).ok, done
    steps = (PROBE_STEPS[0], ProbeStep("ls /no-such-dir-x", "x"), PROBE_STEPS[1])
    done = subprocess.run(probe_script(steps), capture_output=True, timeout=30, check=False)
    assert done.returncode == 3
    verdict = judge("runc", _result(done.stdout, done.returncode, done.stderr), steps)
    assert verdict.failed == "`ls /no-such-dir-x` failed (exit 2)"


# -- on the real engine ----------------------------------------------------


def _probe_containers(docker_client: Any, run_id: str) -> list[Any]:
    return list(
        docker_client.containers.list(all=True, filters={"label": f"{LABEL_PROBE}={run_id}"})
    )


@pytest.fixture
async def backend(docker_client: Any) -> Any:
    b = DockerBackend.from_env()
    yield b
    await b.close()


def _runtimes(docker_client: Any) -> dict[str, Any]:
    return dict(docker_client.info().get("Runtimes") or {})


@pytest.mark.docker
@pytest.mark.parametrize("runtime", [None, "runc", "runsc"])
async def test_S2_runc_and_the_installed_runsc_pass(
    backend: DockerBackend, docker_client: Any, base_image: str, runtime: str | None
) -> None:
    if runtime and runtime not in _runtimes(docker_client):
        pytest.skip(f"the engine has no {runtime} runtime registered")
    verdict = await check_runtime(backend, runtime, base_image)
    assert verdict.ok, verdict.message


@pytest.mark.docker
async def test_S2_probe_is_hardened_and_removed(
    backend: DockerBackend, docker_client: Any, base_image: str
) -> None:
    run_id = secrets.token_hex(6)
    result = await backend.probe(
        "runc",
        base_image,
        ["sh", "-c", "grep CapEff /proc/self/status; id -u; touch /etc/x 2>&1; cat /proc/net/dev"],
        run_id=run_id,
        timeout=30,
    )
    out = result.stdout.decode()
    assert result.exit_code == 0, result
    assert "CapEff:\t0000000000000000" in out
    assert "\n65532\n" in out
    assert "Read-only file system" in out
    assert "eth0" not in out and "lo:" in out  # no network
    assert _probe_containers(docker_client, run_id) == []


@pytest.mark.docker
async def test_S2_unknown_runtime_is_refused_with_a_fix(
    backend: DockerBackend, docker_client: Any, base_image: str
) -> None:
    fake = f"cellgate-no-such-runtime-{secrets.token_hex(4)}"
    verdict = await check_runtime(backend, fake, base_image)
    assert not verdict.ok
    assert verdict.failed == "the engine does not know it"
    assert fake in verdict.detail
    assert "/etc/docker/daemon.json" in verdict.message
    run_id = secrets.token_hex(6)
    with pytest.raises(Exception, match="Unknown runtime"):
        await backend.probe(fake, base_image, ["true"], run_id=run_id, timeout=10)
    assert _probe_containers(docker_client, run_id) == []
