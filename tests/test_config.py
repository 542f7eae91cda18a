"""Config contract: bad config exits 2 naming the key; env overrides; permission refusal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptkeeper.config import ConfigError, load_settings, parse_duration
from ckptkeeper.util.fmt import format_duration

REPO = Path(__file__).resolve().parents[1]


def write_config(tmp_path: Path, body: str, mode: int = 0o600) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(body)
    path.chmod(mode)
    return path


MINIMAL = """
index = "{tmp}/index.db"
[[tiers]]
name = "hot"
url = "{tmp}/hot"
"""


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (90, 90.0),
        ("90", 90.0),
        ("90s", 90.0),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("7d", 604800.0),
        ("1w", 604800.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("1.5h", 5400.0),
    ],
)
def test_durations_parse(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "5x", "m5", "-5m", "5m3", True, None, [], 1e30, float("nan")])
def test_bad_durations_rejected(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_format_duration_round_trips() -> None:
    for text in ["2h", "1h30m", "7d", "45s", "0s"]:
        assert format_duration(parse_duration(text)) == text


def test_example_config_is_valid_and_documents_every_key() -> None:
    settings = load_settings(REPO / "config.example.toml")
    assert [t.name for t in settings.tiers] == ["hot", "warm", "cold"]
    assert settings.tiers[2].url.startswith("s3://")
    text = (REPO / "config.example.toml").read_text()
    for key in type(settings).model_fields:
        assert f"{key}" in text, key
    for section in ("daemon", "reaper"):
        for key in type(getattr(settings, section)).model_fields:
            assert f"\n{key} =" in text or f"# {key} =" in text, f"{section}.{key} undocumented"
    from ckptkeeper.config import TierConfig

    for key in TierConfig.model_fields:
        assert key in text, f"tiers.{key} undocumented"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("[[tiers]]\nname='hot'\nurl='/x'\nkeep_lsat=3\n", "tiers[0].keep_lsat: unknown key"),
        (
            "[[tiers]]\nname='hot'\nurl='/x'\nkeep_last=-1\n",
            "tiers[0].keep_last: Input should be greater than or equal to 0",
        ),
        ("[[tiers]]\nname='hot'\nurl='/x'\nhigh_watermark=1.5\n", "tiers[0].high_watermark:"),
        (
            "[[tiers]]\nname='hot'\nurl='/x'\nhigh_watermark=0.5\nlow_watermark=0.7\n",
            "low_watermark (0.7) must be below",
        ),
        ("[[tiers]]\nname='hot'\nurl='/x'\nkeep_best=1\n", "keep_best needs metric"),
        ("[[tiers]]\nname='hot'\nurl='/x'\nmode='median'\n", "tiers[0].mode:"),
        (
            "[[tiers]]\nname='hot'\nurl='/x'\n[[tiers]]\nname='w'\nurl='/y'\nkeep_within='7x'\n",
            "tiers[1].keep_within: invalid duration",
        ),
        (
            "[[tiers]]\nname='hot'\nurl='s3://b/x'\n",
            "first tier is the watched hot tier and must be a local path",
        ),
        ("[[tiers]]\nname='hot'\nurl='/x'\n[[tiers]]\nname='hot'\nurl='/y'\n", "tier names must be unique"),
        (
            "[[tiers]]\nname='hot'\nurl='/x'\n[reaper]\nfailed_afterr='2h'\n",
            "reaper.failed_afterr: unknown key",
        ),
        (
            "[[tiers]]\nname='hot'\nurl='/x'\n[daemon]\nsettle_seconds='soon'\n",
            "daemon.settle_seconds: invalid duration",
        ),
        ("max_delete = 99999999999999999\n[[tiers]]\nname='hot'\nurl='/x'\n", "max_delete:"),
        ("tiers = []\n", "tiers: List should have at least 1 item"),
        ("[[tiers]]\nname='hot'\nurl='/x'\nkeep_every=0\n", "tiers[0].keep_every:"),
        ("this is not toml", "invalid TOML"),
    ],
)
def test_bad_config_exits_2_naming_the_key(tmp_path: Path, body: str, expected: str) -> None:
    cfg = write_config(tmp_path, body)
    result = run_cli("--config", str(cfg), "ls")
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_every_problem_reported_one_line_each(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "bogus=1\n[[tiers]]\nname='hot'\nurl='/x'\nkeep_lsat=3\nkeep_daily=-2\n")
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert sorted(err.value.problems) == sorted(
        [
            "bogus: unknown key (check the spelling; see config.example.toml)",
            "tiers[0].keep_lsat: unknown key (check the spelling; see config.example.toml)",
            "tiers[0].keep_daily: Input should be greater than or equal to 0",
        ]
    )


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_config_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    cfg = write_config(tmp_path, MINIMAL.format(tmp=tmp_path), mode=mode)
    result = run_cli("--config", str(cfg), "ls")
    assert result.returncode == 2
    assert "writable by group or others" in result.stderr
    assert f"chmod go-w {cfg}" in result.stderr


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = run_cli("--config", str(tmp_path / "nope.toml"), "ls")
    assert result.returncode == 2
    assert "config file not found" in result.stderr


def test_config_path_from_env_and_env_overrides(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, MINIMAL.format(tmp=tmp_path))
    env = {
        "CKPTKEEPER_CONFIG": str(cfg),
        "CKPTKEEPER_MAX_DELETE": "7",
        "CKPTKEEPER_DAEMON__SETTLE_SECONDS": "2m",
        "CKPTKEEPER_REAPER__KEEP_LAST_OF_FAILED": "3",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        settings = load_settings(None)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert settings.max_delete == 7
    assert settings.daemon.settle_seconds == 120.0
    assert settings.reaper.keep_last_of_failed == 3


def test_bad_env_override_names_the_key(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, MINIMAL.format(tmp=tmp_path))
    result = run_cli("ls", env={"CKPTKEEPER_CONFIG": str(cfg), "CKPTKEEPER_REAPER__PARTIAL_AFTER": "later"})
    assert result.returncode == 2
    assert "reaper.partial_after: invalid duration" in result.stderr


def test_watermark_low_defaults_below_high(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "[[tiers]]\nname='hot'\nurl='/x'\nhigh_watermark=0.9\n")
    settings = load_settings(cfg)
    assert settings.tiers[0].low_watermark == pytest.approx(0.75)


def test_help_is_fast_and_light() -> None:
    code = (
        "import sys, ckptkeeper.cli.app as c;"
        "heavy={'s3fs','watchdog','apscheduler','botocore','aiobotocore','fsspec','prometheus_client'};"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
