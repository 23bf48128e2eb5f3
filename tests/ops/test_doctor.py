"""O4: `cellgate doctor` on a good setup, on broken ones, and as JSON; the config stays 0600."""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import orchestrator.doctor as doctor_module
from orchestrator.config import write_config_document
from orchestrator.doctor import DOCTOR_LABEL
from tests.e2e.conftest import install_test_app

REPO = Path(__file__).resolve().parents[2]


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=full,
        check=False,
    )


def by_name(out: str) -> dict[str, dict[str, str]]:
    doc = json.loads(out)
    return {c["name"]: c for c in doc["checks"]}


@pytest.fixture(scope="module")
def good_config(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, base_image: str
) -> Path:
    tmp = tmp_path_factory.mktemp("doctor")
    name = f"doc{secrets.token_hex(3)}"
    return install_test_app(tmp, docker_client, base_image, name, {"baseImage": base_image})


def test_o4_good_setup_all_pass_human_and_json(good_config: Path, docker_client: Any) -> None:
    r = doctor("--config", str(good_config))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
    assert "FAIL" not in r.stdout
    j = doctor("--config", str(good_config), "--json")
    assert j.returncode == 0, j.stdout + j.stderr
    doc = json.loads(j.stdout)
    assert doc["ok"] is True
    checks = by_name(j.stdout)
    for name in ("engine", "base image", "runtime runc", "config", "app images", "permissions"):
        assert checks[name]["status"] == "ok", checks[name]
    assert "Docker" in checks["engine"]["detail"]
    assert checks["quota (R2)"]["status"] == "ok"
    assert checks["resident runner"]["status"] == "ok"  # F2: the native one, built by test.sh
    assert checks["channel tokens"]["status"] == "skip"  # no channel configured
    # the probe containers are gone
    assert docker_client.containers.list(all=True, filters={"label": DOCTOR_LABEL}) == []


def test_o4_engine_unreachable(tmp_path: Path, good_config: Path) -> None:
    dead = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(dead))  # bound, never listening: connections are refused
    try:
        r = doctor("--config", str(good_config), "--json", env={"DOCKER_HOST": f"unix://{dead}"})
    finally:
        s.close()
    assert r.returncode == 1
    checks = by_name(r.stdout)
    engine = checks["engine"]
    assert engine["status"] == "fail"
    assert str(dead) in engine["detail"]
    assert "start the engine" in engine["fix"]
    assert checks["runtime runc"]["status"] == "skip"
    assert checks["base image"]["status"] == "skip"
    assert checks["config"]["status"] == "ok"
    human = doctor("--config", str(good_config), env={"DOCKER_HOST": f"unix://{dead}"})
    assert human.returncode == 1
    assert "FAIL" in human.stdout and "fix: start the engine" in human.stdout


def test_o4_bad_config_reports_every_error_with_file_and_field(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    write_config_document(
        cfg,
        {
            "gateway": {"stateDir": str(tmp_path / "state"), "listen": {"port": 99999}},
            "agents": [{"id": "ok-agent", "isolateMemory": "yes"}],
        },
    )
    r = doctor("--config", str(cfg), "--json")
    assert r.returncode == 1
    check = by_name(r.stdout)["config"]
    assert check["status"] == "fail"
    assert str(cfg) in check["detail"]
    assert "2 error(s)" in check["detail"]
    assert "gateway.listen.port" in check["detail"]
    assert "agents[0].isolateMemory" in check["detail"]
    assert check["fix"]


def test_o4_missing_base_image_is_named_with_its_fix(tmp_path: Path, docker_client: Any) -> None:
    cfg = tmp_path / "config.json"
    missing = f"cellgate-doctor-missing-{secrets.token_hex(4)}:none"
    write_config_document(
        cfg, {"gateway": {"stateDir": str(tmp_path / "state"), "baseImage": missing}}
    )
    r = doctor("--config", str(cfg), "--json")
    assert r.returncode == 1
    checks = by_name(r.stdout)
    assert checks["base image"]["status"] == "fail"
    assert missing in checks["base image"]["detail"]
    # the fix builds the configured name, not another image the check would not find
    assert f"build-base-image.sh {missing}" in checks["base image"]["fix"]
    assert checks["runtime runc"]["status"] == "skip"


def test_o4_the_configured_runtime_is_probed(tmp_path: Path, docker_client: Any) -> None:
    cfg = tmp_path / "config.json"
    write_config_document(
        cfg, {"gateway": {"stateDir": str(tmp_path / "state"), "runtime": "kata-nowhere"}}
    )
    r = doctor("--config", str(cfg), "--json")
    assert r.returncode == 1, r.stdout
    check = by_name(r.stdout)["runtime kata-nowhere"]
    assert check["status"] == "fail" and "not registered" in check["detail"]
    assert "gateway.runtime" in check["fix"]


def test_o4_missing_app_image_is_named(tmp_path: Path, good_config: Path) -> None:
    doc = json.loads(good_config.read_text())
    state = Path(doc["gateway"]["stateDir"])
    app_name = next(a["app"] for a in doc["agents"] if a.get("app"))
    record = state / "apps" / app_name / "app.json"
    app = json.loads(record.read_text())
    copy_state = tmp_path / "state"
    (copy_state / "apps" / app_name).mkdir(parents=True)
    app["image"] = "cellgate-doctor-gone:1"
    app["image_id"] = "sha256:" + "0" * 64
    (copy_state / "apps" / app_name / "app.json").write_text(json.dumps(app))
    cfg = tmp_path / "config.json"
    write_config_document(cfg, {**doc, "gateway": {**doc["gateway"], "stateDir": str(copy_state)}})
    r = doctor("--config", str(cfg), "--json")
    assert r.returncode == 1
    check = by_name(r.stdout)["app images"]
    assert check["status"] == "fail"
    assert "cellgate-doctor-gone:1" in check["detail"]
    assert "cellgate apps install" in check["fix"]


def test_o4_config_rewrite_keeps_0600_and_doctor_flags_0644(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    write_config_document(cfg, {"gateway": {"stateDir": str(tmp_path / "state")}})
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600  # a new file holds secrets: 0600
    write_config_document(cfg, {"gateway": {"stateDir": str(tmp_path / "state")}, "agents": []})
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600  # a rewrite keeps it
    cfg.chmod(0o644)
    r = doctor("--config", str(cfg), "--json")
    check = by_name(r.stdout)["permissions"]
    assert check["status"] == "fail"
    assert "0644" in check["detail"]
    assert f"chmod 600 {cfg}" in check["fix"]
    assert r.returncode == 1


def test_o4_channel_tokens_missing_are_named(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    var = f"CELLGATE_DOCTOR_TOKEN_{secrets.token_hex(3).upper()}"
    write_config_document(
        cfg,
        {
            "gateway": {"stateDir": str(tmp_path / "state")},
            "channels": {"telegram": {"botTokenEnv": var}},
        },
    )
    r = doctor("--config", str(cfg), "--json", env={var: ""})
    check = by_name(r.stdout)["channel tokens"]
    assert check["status"] == "fail"
    assert f"${var}" in check["detail"]
    ok = doctor("--config", str(cfg), "--json", env={var: "123:abc"})
    check = by_name(ok.stdout)["channel tokens"]
    assert check["status"] == "ok"
    assert "123:abc" not in ok.stdout  # a token is never printed


def test_o4_quota_off_is_a_warning_not_a_failure_where_loop_images_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under Compose the gateway cannot loop-mount (R2): with `quota: "off"` doctor warns
    and says what that costs; with the default `"required"` it fails with the fix."""
    from orchestrator import doctor
    from orchestrator.config import load_config

    monkeypatch.setattr(doctor, "_loop_quota", lambda work: "no loop device")
    monkeypatch.setattr(doctor, "_project_quota", lambda path: False)
    for quota, status in (("off", "warn"), ("required", "fail")):
        path = tmp_path / f"{quota}.json"
        write_config_document(
            path, {"gateway": {"stateDir": str(tmp_path / "state"), "quota": quota}, "agents": []}
        )
        check = doctor._quota(doctor._Facts(path, cfg=load_config(path)))
        assert check.status == status, check
        assert "no loop device" in check.detail and check.fix


def test_O4_doctor_words_config_errors_as_serve_does() -> None:
    """An operator reads one wording for one mistake, whichever command found it."""
    from orchestrator.doctor import config_errors

    errors = config_errors({"gateway": {"sandboxIdleMinute": 5}, "agents": []})
    assert errors == ["gateway.sandboxIdleMinute: unknown field (check its spelling)"]


def test_O4_a_bad_agent_entry_is_a_warning_as_serve_skips_it(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    write_config_document(
        cfg,
        {
            "gateway": {"stateDir": str(tmp_path / "state")},
            "agents": [
                {"id": "good-agent", "harness": {"type": "command", "argv": ["true"]}},
                {"id": "bad-agent", "isolateMemory": "yes"},
            ],
        },
    )
    check = by_name(doctor("--config", str(cfg), "--json").stdout)["config"]
    assert check["status"] == "warn", check
    assert "good-agent" in check["detail"] and "agents[1].isolateMemory" in check["detail"]


def test_O4_F2_doctor_says_which_runner_and_how_to_build_the_native_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    facts = doctor_module._Facts(None)
    assert doctor_module._runner(facts).status == "ok"
    monkeypatch.setattr(doctor_module, "native_runner", lambda: None)
    check = doctor_module._runner(facts)
    assert check.status == "warn" and "scripts/build-runner.sh" in check.fix
