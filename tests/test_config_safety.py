"""Configs that cannot overlap, through the real CLI (docs/configuration-safety.md).

Tiers that are one place or one inside the other (either way, through a symlink or a bind mount),
two object-store tiers on one bucket and prefix, relative tier or index paths, an unparsable
environment override and an unknown ``CKPTKEEPER_*`` variable: each exits 2 at config load with
one line per problem naming the key (or the variable), before any command looks at a tier.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from builders import local_tier, write_config

REPO = Path(__file__).resolve().parents[1]


def cli(
    config: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.upper().startswith("CKPTKEEPER_")}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=120,
        cwd=cwd,
    )


def config(tmp_path: Path, *urls: str | Path, index: str | Path | None = None, **extra: object) -> Path:
    tiers = [
        local_tier(name, url) for name, url in zip(("hot", "warm", "cold", "archive"), urls, strict=False)
    ]
    for t in tiers:
        t.update(extra.get(t["name"], {}))  # type: ignore[call-overload]
    return write_config(tmp_path / "config.toml", index=index or tmp_path / "index.db", tiers=tiers)


def refused(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def errors(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("config error: ")]


# --------------------------------------------------------------------------------------------
# overlapping tiers


def test_warm_inside_hot_is_refused_before_anything_is_cataloged(tmp_path: Path) -> None:
    """Warm inside hot: its copies were cataloged as a hot run named "warm" and reaped."""
    (tmp_path / "hot" / "warm" / "exp").mkdir(parents=True)
    cfg = config(tmp_path, tmp_path / "hot", tmp_path / "hot" / "warm")
    result = cli(cfg, "scan")
    refused(result, "tiers[1].url:", "is inside tiers[0].url", str(tmp_path / "hot"))
    assert not (tmp_path / "index.db").exists()  # refused at load: nothing was even indexed


def test_hot_inside_warm_is_refused(tmp_path: Path) -> None:
    cfg = config(tmp_path, tmp_path / "w" / "hot", tmp_path / "w")
    refused(cli(cfg, "ls"), "tiers[1].url:", "holds tiers[0].url")


@pytest.mark.parametrize("spelling", ["{p}/", "{p}/.", "{p}/../hot", "file://{p}", "{p}//"])
def test_one_directory_spelled_twice_is_refused(tmp_path: Path, spelling: str) -> None:
    hot = tmp_path / "hot"
    hot.mkdir()
    cfg = config(tmp_path, hot, tmp_path / "warm", spelling.format(p=hot))
    refused(cli(cfg, "ls"), "tiers[2].url:", "is the same place as tiers[0].url")


def test_a_symlink_into_hot_is_refused(tmp_path: Path) -> None:
    (tmp_path / "hot" / "sub").mkdir(parents=True)
    (tmp_path / "elsewhere").symlink_to(tmp_path / "hot" / "sub")
    cfg = config(tmp_path, tmp_path / "hot", tmp_path / "elsewhere" / "warm")
    refused(cli(cfg, "ls"), "tiers[1].url:", "is inside tiers[0].url")


def test_a_bind_mount_of_hot_is_refused(tmp_path: Path) -> None:
    (tmp_path / "hot").mkdir()
    (tmp_path / "bind").mkdir()
    mounted = subprocess.run(
        ["mount", "--bind", str(tmp_path / "hot"), str(tmp_path / "bind")], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.strip()}")
    try:
        same = config(tmp_path, tmp_path / "hot", tmp_path / "bind")
        refused(cli(same, "ls"), "tiers[1].url:", "is the same place as tiers[0].url")
        inside = config(tmp_path, tmp_path / "hot", tmp_path / "bind" / "warm")
        refused(cli(inside, "ls"), "tiers[1].url:", "is inside tiers[0].url")
    finally:
        subprocess.run(["umount", str(tmp_path / "bind")], check=True)


def test_siblings_with_a_common_name_prefix_are_fine(tmp_path: Path) -> None:
    """/x/hot and /x/hot2 share characters, not a directory."""
    cfg = config(tmp_path, tmp_path / "hot", tmp_path / "hot2", tmp_path / "hot-cold")
    result = cli(cfg, "ls")
    assert result.returncode == 0, result.stderr


def _s3(name: str, url: str, endpoint: str = "http://127.0.0.1:9") -> dict[str, object]:
    return {"name": name, "url": url, "storage_options": {"endpoint_url": endpoint}}


@pytest.mark.parametrize(
    ("warm", "cold", "needle"),
    [
        ("s3://b/ckpt", "s3://b/ckpt", "is the same place as tiers[1].url"),
        ("s3://b/ckpt/", "s3a://b/ckpt", "is the same place as tiers[1].url"),
        ("s3://b/ckpt", "s3://b/ckpt/archive", "is inside tiers[1].url"),
        ("s3://b/ckpt/archive", "s3://b", "holds tiers[1].url"),
    ],
)
def test_object_store_tiers_on_one_bucket_prefix_are_refused(
    tmp_path: Path, warm: str, cold: str, needle: str
) -> None:
    """Two tiers on one bucket + prefix: a "redundant copy" delete in one wiped the other."""
    tiers = [local_tier("hot", tmp_path / "hot"), _s3("warm", warm), _s3("cold", cold)]
    cfg = write_config(tmp_path / "config.toml", index=tmp_path / "index.db", tiers=tiers)
    refused(cli(cfg, "ls"), "tiers[2].url:", needle)


@pytest.mark.parametrize(
    ("warm", "cold", "endpoints"),
    [
        ("s3://b/a", "s3://b/ab", ("http://127.0.0.1:9", "http://127.0.0.1:9")),
        ("s3://b/a", "s3://c/a", ("http://127.0.0.1:9", "http://127.0.0.1:9")),
        ("s3://b/a", "s3://b/a", ("http://127.0.0.1:9", "http://10.0.0.1:9")),
    ],
    ids=["sibling-prefix", "other-bucket", "other-store"],
)
def test_object_store_tiers_apart_are_fine(
    tmp_path: Path, warm: str, cold: str, endpoints: tuple[str, str]
) -> None:
    tiers = [
        local_tier("hot", tmp_path / "hot"),
        _s3("warm", warm, endpoints[0]),
        _s3("cold", cold, endpoints[1]),
    ]
    cfg = write_config(tmp_path / "config.toml", index=tmp_path / "index.db", tiers=tiers)
    result = cli(cfg, "ls")
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------------------------
# relative paths


def test_relative_tier_path_is_refused_wherever_the_command_runs(tmp_path: Path) -> None:
    """``url = "warm"`` resolved against the working directory: a prune run elsewhere demoted
    into ``<cwd>/warm``."""
    (tmp_path / "hot").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cfg = config(tmp_path, tmp_path / "hot", "warm")
    result = cli(cfg, "prune", cwd=elsewhere)
    refused(result, "tiers[1].url: relative path 'warm'", "use an absolute path")
    assert list(elsewhere.iterdir()) == []


def test_relative_index_is_refused(tmp_path: Path) -> None:
    cfg = config(tmp_path, tmp_path / "hot", index="state/index.db")
    refused(cli(cfg, "ls", cwd=tmp_path), "index: relative path 'state/index.db'")
    assert not (tmp_path / "state").exists()


def test_every_problem_is_one_line(tmp_path: Path) -> None:
    cfg = config(tmp_path, tmp_path / "hot", tmp_path / "hot" / "w", "cold", index="i.db")
    result = cli(cfg, "ls")
    assert result.returncode == 2
    assert [line.split(":", 2)[1].strip() for line in errors(result)] == [
        "index",
        "tiers[2].url",
        "tiers[1].url",
    ]


# --------------------------------------------------------------------------------------------
# the environment


def test_unparsable_environment_override_exits_2_naming_the_variable(tmp_path: Path) -> None:
    cfg = config(tmp_path, tmp_path / "hot")
    result = cli(cfg, "ls", env={"CKPTKEEPER_DAEMON": "notjson"})
    refused(result, "CKPTKEEPER_DAEMON: not valid JSON", "CKPTKEEPER_DAEMON__<KEY>")
    result = cli(cfg, "ls", env={"CKPTKEEPER_TIERS": "[{"})
    refused(result, "CKPTKEEPER_TIERS: not valid JSON")


def test_unknown_environment_variable_exits_2_naming_it(tmp_path: Path) -> None:
    """A typo (``MAX_DELET``) was silently ignored: the guard it meant to set stayed what it was."""
    cfg = config(tmp_path, tmp_path / "hot")
    result = cli(cfg, "prune", env={"CKPTKEEPER_MAX_DELET": "0", "CKPTKEEPER_DAEMON__SETTL_SECONDS": "1"})
    refused(
        result, "CKPTKEEPER_MAX_DELET: no setting 'max_delet'", "CKPTKEEPER_DAEMON__SETTL_SECONDS: no key"
    )
    assert len(errors(result)) == 2


def test_bad_value_from_the_environment_names_the_variable(tmp_path: Path) -> None:
    cfg = config(tmp_path, tmp_path / "hot")
    refused(cli(cfg, "ls", env={"CKPTKEEPER_MAX_DELETE": "many"}), "max_delete:", "CKPTKEEPER_MAX_DELETE")


def test_settings_and_the_projects_own_variables_are_accepted(tmp_path: Path) -> None:
    cfg = config(tmp_path, tmp_path / "hot")
    env = {
        "CKPTKEEPER_MAX_DELETE": "7",
        "CKPTKEEPER_DAEMON": '{"settle_seconds": "2m"}',
        "CKPTKEEPER_REAPER__FAILED_AFTER": "3h",
        "CKPTKEEPER_NODE": "n1",
        "CKPTKEEPER_STRESS_TRIALS": "3",
        "CKPTKEEPER_UPDATE_GOLDEN": "0",
    }
    result = cli(cfg, "ls", env=env)
    assert result.returncode == 0, result.stderr


def test_every_ckptkeeper_variable_the_project_names_is_allowed() -> None:
    """A variable the code, the tests or the deploy files name is a setting or a declared
    non-setting: a new one that is neither would make every command exit 2 where it is set."""
    from ckptkeeper.config import Settings
    from ckptkeeper.config_checks import env_problems

    names: set[str] = set()
    for base in ("ckptkeeper", "tests", "deploy", "bench"):
        for path in (REPO / base).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".sh", ".service", ".yaml", ".yml", ".toml", ""):
                try:
                    text = path.read_text()
                except (UnicodeDecodeError, OSError):
                    continue
                names |= set(
                    re.findall(r"(?<![A-Za-z_])CKPTKEEPER_[A-Z0-9]+(?:_[A-Z0-9]+)*(?:__[A-Z0-9_]+)?", text)
                )
    # names written as examples of mistakes, in this module and the config tests
    names -= {
        "CKPTKEEPER_MAX_DELET",
        "CKPTKEEPER_DAEMON__SETTL_SECONDS",
        "CKPTKEEPER_DAEMON__SETTL",
        "CKPTKEEPER_NODE__X",
    }
    assert names, "found no CKPTKEEPER_ variable at all"
    assert env_problems(dict.fromkeys(names, "{}"), Settings) == []
