"""The environment's tooling: the binary cache and the `python -m preshard_devenv` commands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from preshard_devenv import binaries, versions
from preshard_devenv.procs import DevEnvError


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PRESHARD_CACHE_DIR", str(cache))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    return cache


def test_a_cached_build_is_reused_without_go(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = empty_cache / "bin" / f"kwok-{versions.KWOK}"
    built.mkdir(parents=True)
    (built / "kwok").write_text("")
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("GOROOT", raising=False)
    assert binaries.tool_path("kwok") == built / "kwok"


def test_a_missing_go_toolchain_says_how_to_fix_it(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("GOROOT", raising=False)
    with pytest.raises(DevEnvError, match=r"Go toolchain is missing.*Install Go"):
        binaries.tool_path("helm")
    assert not (empty_cache / "bin" / f"helm-{versions.HELM}").exists()


def test_a_failed_build_names_the_step_and_leaves_nothing_behind(
    empty_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real `go` that may not download anything: the module resolution step fails.
    monkeypatch.setenv("GOPROXY", "off")
    monkeypatch.setenv("GOMODCACHE", str(tmp_path / "gomod"))
    monkeypatch.setenv("GOFLAGS", "-modcacherw")
    with pytest.raises(DevEnvError) as failed:
        binaries.tool_path("etcd")
    text = str(failed.value)
    assert "failed at step 'resolve go.etcd.io/etcd/server/v3'" in text
    assert "GOPROXY=off" in text
    assert "python -m preshard_devenv build" in text
    assert [p.name for p in (empty_cache / "bin").iterdir()] == [f".etcd-{versions.ETCD}.lock"]


def test_envtest_assets_take_precedence(
    empty_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    kubectl = assets / "kubectl"
    kubectl.write_text("")
    kubectl.chmod(0o755)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(assets))
    assert binaries.tool_path("kubectl") == kubectl


def test_an_unknown_tool_is_an_error() -> None:
    with pytest.raises(DevEnvError, match="unknown tool 'kind'; known tools: etcd, helm"):
        binaries.tool_path("kind")


def _devenv(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "preshard_devenv", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.cluster
def test_up_status_down(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    up = _devenv("up", "--state-dir", str(state_dir), cwd=tmp_path)
    try:
        assert up.returncode == 0, up.stderr
        kubeconfig = state_dir / "cluster" / "kubeconfigs" / "admin.kubeconfig"
        assert f"export KUBECONFIG={kubeconfig}" in up.stdout
        env_file = state_dir / "env"
        assert env_file.stat().st_mode & 0o777 == 0o600
        secret = next(
            line.split("=", 1)[1]
            for line in env_file.read_text().splitlines()
            if line.startswith("AWS_SECRET_ACCESS_KEY=")
        )
        assert secret not in up.stdout + up.stderr

        again = _devenv("up", "--state-dir", str(state_dir), cwd=tmp_path)
        assert again.returncode == 0
        assert "already up" in again.stdout

        kubectl = binaries.tool_path("kubectl")
        nodes = subprocess.run(
            [str(kubectl), "get", "nodes", "-o", "name"],
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert "node/kwok-gpu-0" in nodes.stdout
        assert _devenv("status", "--state-dir", str(state_dir), cwd=tmp_path).returncode == 0
    finally:
        down = _devenv("down", "--state-dir", str(state_dir), cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    status = _devenv("status", "--state-dir", str(state_dir), cwd=tmp_path)
    assert status.returncode == 1
    assert "down" in status.stdout


def test_tool_path_prints_the_cached_binary(tmp_path: Path) -> None:
    result = _devenv("tool-path", "kubectl", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == binaries.tool_path("kubectl")


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_make_run_stops_as_on_ctrl_c_on_kill_a_closed_terminal_and_in_the_background(
    name: str,
) -> None:
    # `make run` and the test session clean up on the KeyboardInterrupt these signals raise
    # (tests/e2e/test_make_run.py); SIGINT starts ignored, as in a shell's background job.
    code = "\n".join(
        (
            "import os, signal",
            "from preshard_devenv import procs",
            "signal.signal(signal.SIGINT, signal.SIG_IGN)",
            "procs.interrupt_on_signals()",
            "try:",
            f"    os.kill(os.getpid(), signal.{name})",
            "    signal.pause()",
            "except KeyboardInterrupt:",
            "    print('interrupted')",
        )
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert (result.returncode, result.stdout) == (0, "interrupted\n"), result.stderr
