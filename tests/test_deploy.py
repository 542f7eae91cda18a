"""The systemd deployment files: the unit verifies, the sysusers/tmpfiles snippets parse and apply.

``systemd-analyze verify`` loads the unit the way systemd would (unknown keys, bad values, a missing
``ExecStart`` binary) without needing systemd as PID 1; it exits 0 even when it warns, so the test
reads its output, and a deliberately broken unit checks that warnings are visible here at all.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNIT = DEPLOY / "ckptkeeper.service"
ANALYZE = shutil.which("systemd-analyze")


def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "notice", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}
    return subprocess.run(
        [ANALYZE, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=unit.parent,
    )


def _mentions(result: subprocess.CompletedProcess[str], unit: Path) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if unit.name in line]


def _runnable_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointed at this interpreter: verify insists the binary exists."""
    text = UNIT.read_text()
    exec_start = f"ExecStart={sys.executable} -m ckptkeeper.cli daemon"
    assert text.count("\nExecStart=/usr/bin/ckptkeeper daemon\n") == 1
    copy = tmp_path / "ckptkeeper.service"
    copy.write_text(text.replace("ExecStart=/usr/bin/ckptkeeper daemon", exec_start))
    return copy


def _unit_settings() -> dict[str, list[str]]:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    out: dict[str, list[str]] = {}
    for section in parser.sections():
        for key, value in parser.items(section):
            out.setdefault(f"{section}.{key}", []).append(value)
    return out


def test_unit_has_the_documented_settings() -> None:
    s = {k: v[-1] for k, v in _unit_settings().items()}
    expected = {
        "Service.Type": "notify",
        "Service.NotifyAccess": "main",
        "Service.WatchdogSec": "60",
        "Service.Restart": "on-failure",
        "Service.RestartSec": "5",
        "Service.User": "ckptkeeper",
        "Service.Group": "ckptkeeper",
        "Service.StateDirectory": "ckptkeeper",
        "Service.ConfigurationDirectory": "ckptkeeper",
        "Service.ExecStart": "/usr/bin/ckptkeeper daemon",
        "Service.ExecReload": "/bin/kill -HUP $MAINPID",
        "Service.ProtectSystem": "strict",
        "Service.ProtectHome": "read-only",
        "Service.NoNewPrivileges": "yes",
        "Service.PrivateTmp": "yes",
        "Service.Nice": "10",
        "Service.CPUSchedulingPolicy": "batch",
        "Service.CPUWeight": "20",
        "Service.IOWeight": "20",
        "Service.MemoryMax": "512M",
        "Service.KillSignal": "SIGTERM",
        "Service.TimeoutStopSec": "120",
        "Service.Environment": "CKPTKEEPER_CONFIG=/etc/ckptkeeper/config.toml",
        "Install.WantedBy": "multi-user.target",
    }
    for key, value in expected.items():
        assert s.get(key) == value, key
    assert "/nvme/checkpoints" in s["Service.ReadWritePaths"]
    assert "/mnt/warm/ckpt" in s["Service.ReadWritePaths"]


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = _runnable_copy(tmp_path)
    result = _verify(unit)
    problems = _mentions(result, unit)

    # Control: a broken unit must produce a warning here, or the clean result above proves nothing.
    broken = tmp_path / "broken.service"
    broken.write_text(unit.read_text().replace("[Service]\n", "[Service]\nNoSuchDirective=1\n", 1))
    control = _verify(broken)
    if not _mentions(control, broken):
        pytest.skip(
            "systemd-analyze verify cannot check units in this environment: "
            + (control.stdout + control.stderr).strip()[-500:]
        )
    assert result.returncode == 0, result.stdout + result.stderr
    assert problems == [], "\n".join(problems)


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
def test_verify_catches_a_missing_binary(tmp_path: Path) -> None:
    unit = tmp_path / "ckptkeeper.service"
    unit.write_text(UNIT.read_text().replace("/usr/bin/ckptkeeper", "/nonexistent/ckptkeeper"))
    result = _verify(unit)
    if result.returncode == 0 and not _mentions(result, unit):
        pytest.skip("systemd-analyze verify does not check ExecStart here")
    assert "/nonexistent/ckptkeeper" in result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed")
def test_sysusers_snippet() -> None:
    snippet = DEPLOY / "ckptkeeper.sysusers"
    result = subprocess.run(
        ["systemd-sysusers", "--dry-run", str(snippet)], capture_output=True, text=True, timeout=60
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "ignoring" not in out.lower(), out
    lines = [ln.split() for ln in snippet.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines == [["u", "ckptkeeper", "-", '"ckptkeeper', 'daemon"', "/var/lib/ckptkeeper"]]


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="systemd-tmpfiles is not installed")
def test_tmpfiles_snippet_creates_the_directories(tmp_path: Path) -> None:
    # tmpfiles resolves owners through this host's users; the ckptkeeper user does not exist here,
    # so apply a copy owned by root to check syntax and modes.
    snippet = tmp_path / "ckptkeeper.conf"
    snippet.write_text(
        (DEPLOY / "ckptkeeper.tmpfiles")
        .read_text()
        .replace("ckptkeeper ckptkeeper", "root root")
        .replace("root       ckptkeeper", "root root")
    )
    root = tmp_path / "root"
    root.mkdir()
    result = subprocess.run(
        ["systemd-tmpfiles", f"--root={root}", "--create", str(snippet)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for path in ("var/lib/ckptkeeper", "etc/ckptkeeper"):
        st = (root / path).stat()
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o750, path


def _security_exposure(unit: Path) -> float | None:
    """``systemd-analyze security --offline=yes``'s overall exposure, or None if it cannot say."""
    assert ANALYZE is not None
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "notice", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}
    result = subprocess.run(
        [ANALYZE, "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=unit.parent,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", result.stdout + result.stderr)
    return float(match.group(1)) if match else None


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
def test_offline_security_exposure_is_at_most_2(tmp_path: Path) -> None:
    unit = _runnable_copy(tmp_path)
    exposure = _security_exposure(unit)
    if exposure is None:
        pytest.skip("this systemd-analyze has no `security --offline`")
    # Control: the same unit without its sandboxing scores worse, so the number is the unit's.
    bare = tmp_path / "bare.service"
    keep = ("[", "Type=", "ExecStart=", "User=", "Group=", "Description=", "WantedBy=")
    bare.write_text("\n".join(line for line in unit.read_text().splitlines() if line.startswith(keep)) + "\n")
    bare_exposure = _security_exposure(bare)
    assert bare_exposure is not None and bare_exposure > 5.0
    assert exposure <= 2.0
