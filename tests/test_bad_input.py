"""Hostile or broken input never makes ckptkeeper delete outside its roots, crash, or stop.

* symlinks and hardlinks leading outside the roots (in hot and in warm), and directories swapped
  for symlinks in the middle of a delete or a copy (docs/design.md, safety invariant 4);
* ``..`` and absolute paths in hook commit lines and in manifests of a slower tier;
* NUL and non-UTF-8 bytes in names and in hook lines;
* malformed ``commits.jsonl``, manifests and ``trainer_state.json`` — truncated, not objects, and
  JSON nesting bombs, which used to raise RecursionError through every scan and prune;
* huge, negative and zero numbers, NUL bytes in config, and a config others may write.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, write_config

HOUR = 3600.0
BOMB = "[" * 100_000 + "]" * 100_000


def hf(run: Path, step: int, *, state: str | None = None, name: str | None = None) -> Path:
    ckpt = run / (name or f"checkpoint-{step}")
    (ckpt / "nested").mkdir(parents=True)
    payload = os.urandom(8000)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2000], "data_offsets": [0, 8000]}}).encode()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + payload)
    (ckpt / "nested" / "optimizer.pt").write_bytes(os.urandom(3000))
    (ckpt / "trainer_state.json").write_text(
        state if state is not None else json.dumps({"global_step": step, "log_history": []})
    )
    return ckpt


def age_tree(root: Path, seconds: float) -> None:
    when = time.time() - seconds
    for dirpath, dirnames, filenames in os.walk(root):
        for n in (*dirnames, *filenames):
            os.utime(os.path.join(dirpath, n), (when, when), follow_symlinks=False)


def snapshot(root: Path) -> dict[str, tuple[str, Any]]:
    """Every entry under ``root`` (symlinks not followed): type and content/target/inode."""
    out: dict[str, tuple[str, Any]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for n in (*dirnames, *filenames):
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir", None)
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", (f.read(), st.st_ino))
    return out


class Node:
    def __init__(self, tmp: Path, hot: dict[str, Any] | None = None, **top: Any) -> None:
        """hot (policy ``hot``, by default last 1) and warm (last 1); ``top``: top-level keys."""
        self.tmp = tmp
        self.hot = tmp / "hot"
        self.warm = tmp / "warm"
        self.outside = tmp / "outside"
        for d in (self.hot, self.warm, self.outside):
            d.mkdir(exist_ok=True)
        self.config = tmp / "config.toml"
        write_config(
            self.config,
            index=tmp / "index.db",
            daemon={
                "settle_seconds": "1s",
                "trust_mtimes": True,
                "metrics_addr": "",
                "retention_interval": "1s",
                "reap_interval": "1s",
            },
            tiers=[
                local_tier("hot", self.hot, **(hot or {"keep_last": 1})),
                local_tier("warm", self.warm, keep_last=1),
            ],
            **top,
        )
        (self.outside / "precious.bin").write_bytes(b"outside the roots" * 50)
        (self.outside / "sub").mkdir()
        (self.outside / "sub" / "deep.bin").write_bytes(b"deep outside" * 50)
        (self.outside / "hard.bin").write_bytes(b"hardlinked from inside" * 50)

    def cli(
        self, *args: str, wrapper: str | None = None, timeout: float = 120, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        head = [sys.executable, "-c", wrapper] if wrapper else [sys.executable, "-m", "ckptkeeper.cli"]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}, **(env or {})}
        return subprocess.run(
            [*head, "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )


# -- links ----------------------------------------------------------------------------------------


def test_symlinks_and_hardlinks_to_outside_are_never_followed_nor_their_targets_deleted(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path)
    run = node.hot / "r"
    for step in (1, 2, 3, 4):
        hf(run, step)
    os.symlink(node.outside, run / "checkpoint-1" / "escape")  # a link inside an expiring checkpoint
    os.symlink(node.outside / "precious.bin", run / "checkpoint-2" / "nested" / "p.bin")
    os.link(node.outside / "hard.bin", run / "checkpoint-3" / "shared.bin")  # same inode as outside
    os.symlink(node.outside / "sub", run / "checkpoint-5")  # a "checkpoint" that is a link
    os.symlink(node.outside, node.hot / "linked-run")  # a "run" that is a link
    (node.outside / "checkpoint-9").mkdir()
    os.symlink(node.outside, node.warm / "w")  # a warm "run" that is a link, with a manifest in it
    (node.outside / "checkpoint-9.ckptkeeper-manifest.json").write_text(
        json.dumps(
            {
                "version": 1,
                "run": "w",
                "step": 9,
                "name": "checkpoint-9",
                "layout": "hf",
                "is_dir": True,
                "files": [],
            }
        )
    )
    age_tree(node.hot, HOUR)
    outside_before = snapshot(node.outside)
    result = node.cli("prune")
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4", "checkpoint-5"]  # 1-3 moved/expired
    assert snapshot(node.outside) == outside_before  # every byte, link and inode outside intact
    assert (node.outside / "hard.bin").stat().st_nlink == 1  # only our name of it went away
    ls = json.loads(node.cli("ls", "--json").stdout)
    assert {r["name"] for r in ls["runs"]} == {"r"}  # neither linked run was cataloged


SWAP_IN_DELETE = """
import os, sys
import ckptkeeper.storage.local as _local
import ckptkeeper.storage.localfs as _localfs
_remove_tree = _localfs._remove_tree
done = []
def remove_tree(dir_fd, name, dev):
    if not done and ".ckptkeeper-tmp-" in name:
        done.append(name)
        # a racing process swaps a directory inside the doomed checkpoint for a link outside
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=dir_fd)
        os.rename("nested", "nested-away", src_dir_fd=fd, dst_dir_fd=fd)
        os.symlink(os.environ["OUTSIDE"], "nested", dir_fd=fd)
        os.close(fd)
    return _remove_tree(dir_fd, name, dev)
_local._remove_tree = _localfs._remove_tree = remove_tree  # looked up by delete and by a sink's abort
_delete = _local.LocalTierStorage.delete
def delete(self, rel):
    if self.hot and rel.endswith("checkpoint-2"):
        # the whole checkpoint dir swapped for a link just before the delete
        path = os.path.join(str(self.root), rel)
        os.rename(path, path + "-moved-by-someone")
        os.symlink(os.environ["OUTSIDE"], path)
    return _delete(self, rel)
_local.LocalTierStorage.delete = delete
_rename_from = _local.LocalTierStorage.rename_from
def rename_from(self, src, manifest, **kw):
    # a directory inside the checkpoint being moved swapped for a link just before the rename
    ckpt = os.path.join(str(src.root), manifest.run, manifest.name)
    os.rename(os.path.join(ckpt, "nested"), os.path.join(ckpt, "nested-away"))
    os.symlink(os.environ["OUTSIDE"], os.path.join(ckpt, "nested"))
    return _rename_from(self, src, manifest, **kw)
_local.LocalTierStorage.rename_from = rename_from
from ckptkeeper.cli import main
sys.exit(main())
"""


def test_directories_swapped_for_symlinks_mid_delete_are_never_followed(tmp_path: Path) -> None:
    """A racing process swaps a directory inside a checkpoint being deleted, a whole checkpoint
    directory, and a directory inside a checkpoint being moved, for symlinks to outside the root:
    deletes unlink the links and never remove anything through them; the move is refused."""
    node = Node(tmp_path)
    node.config.write_text(
        node.config.read_text().replace(
            f'url = "{node.warm}"\nkeep_last = 1', f'url = "{node.warm}"\nkeep_last = 2'
        )
    )
    run = node.hot / "r"  # hot keeps 4, warm keeps 3 and 4: 3 moves, 1 and 2 expire
    for step in (1, 2, 3, 4):
        hf(run, step)
    age_tree(node.hot, HOUR)
    outside_before = snapshot(node.outside)
    result = node.cli("prune", wrapper=SWAP_IN_DELETE, env={"OUTSIDE": str(node.outside)})
    assert result.returncode in (0, 1), result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(node.outside) == outside_before
    assert (run / "checkpoint-2-moved-by-someone" / "model.safetensors").is_file()  # theirs, untouched
    assert not (run / "checkpoint-1").exists() and not (run / "checkpoint-2").is_symlink()
    assert "does not match its manifest" in result.stderr  # the move of 3 was refused
    assert (run / "checkpoint-3" / "nested-away" / "optimizer.pt").is_file()  # left where it was
    assert not (node.warm / "r" / "checkpoint-3").exists()


# -- paths in hook lines and manifests ------------------------------------------------------------


def test_dotdot_absolute_nul_and_non_utf8_in_commit_lines_are_rejected_and_logged(tmp_path: Path) -> None:
    node = Node(tmp_path)
    run = node.hot / "r"
    hf(run, 1)
    hf(run, 2)
    control = run / ".ckptkeeper"
    control.mkdir()
    good = json.dumps({"path": "checkpoint-2", "step": 2, "metrics": {"eval_loss": 0.5}, "time": time.time()})
    bad_lines = [
        json.dumps({"path": "../../outside/precious.bin", "step": 5, "time": 1.0}).encode(),
        json.dumps({"path": str(node.outside / "precious.bin"), "step": 6, "time": 1.0}).encode(),
        json.dumps({"path": "checkpoint-1/../../../outside", "step": 7, "time": 1.0}).encode(),
        json.dumps({"path": ".ckptkeeper/commits.jsonl", "step": 8, "time": 1.0}).encode(),
        b'{"path": "checkpoint-1\x00x", "step": 1, "time": 1.0}',
        b'{"path": "checkpoint-\xff\xfe", "step": 1, "time": 1.0}',
        ('{"path": "checkpoint-1", "step": 1, "time": 1.0, "metrics": ' + BOMB + "}").encode(),
        b'{"path": "checkpoint-1", "step": -3, "time": 1.0}',
        b'{"path": "checkpoint-1", "step": 99999999999999999999999999, "time": 1.0}',
        b"[1, 2, 3]",
        b'{"path": "checkpoint-1", "st',  # truncated in the middle
    ]
    (control / "commits.jsonl").write_bytes(b"\n".join([*bad_lines, good.encode()]) + b"\n" + b'{"torn": ')
    age_tree(node.hot, HOUR)
    outside_before = snapshot(node.outside)
    scan = node.cli("scan")
    assert scan.returncode == 0, scan.stderr
    problems = [json.loads(line) for line in scan.stderr.splitlines() if "malformed hook commit line" in line]
    assert len(problems) >= len(bad_lines), scan.stderr[-3000:]
    ls = json.loads(node.cli("ls", "--json").stdout)
    (r,) = ls["runs"]
    two = next(c for c in r["checkpoints"] if c["step"] == 2)
    assert two["metrics"] == {"eval_loss": 0.5}  # the good line after all the bad ones still counts
    assert {c["step"] for c in r["checkpoints"]} == {1, 2}
    assert node.cli("prune").returncode == 0
    assert snapshot(node.outside) == outside_before


def test_hostile_manifests_in_a_slower_tier_are_ignored_and_delete_nothing_outside(tmp_path: Path) -> None:
    node = Node(tmp_path)
    hf(node.hot / "r", 1)
    evil = node.warm / "r"
    evil.mkdir()
    docs = {
        "checkpoint-7": {
            "name": "checkpoint-7",
            "files": [{"path": "../../../outside/precious.bin", "size": 850, "hash": "0"}],
        },
        "checkpoint-8": {"name": "../../outside", "files": []},
        "checkpoint-9": {
            "name": "checkpoint-9",
            "files": [{"path": str(node.outside / "precious.bin"), "size": 1, "hash": "0"}],
        },
    }
    for name, doc in docs.items():
        (evil / name).mkdir()
        (evil / name / "model.bin").write_bytes(b"x")
        full = {
            "version": 1,
            "run": "r",
            "step": int(name.split("-")[1]),
            "layout": "hf",
            "is_dir": True,
            **doc,
        }
        (evil / f"{name}.ckptkeeper-manifest.json").write_text(json.dumps(full))
    (evil / "checkpoint-10").mkdir()
    (evil / "checkpoint-10.ckptkeeper-manifest.json").write_text(BOMB)  # a nesting bomb
    (evil / "checkpoint-11").mkdir()
    (evil / "checkpoint-11.ckptkeeper-manifest.json").write_bytes(b"\xff\xfe not json \x00")
    age_tree(node.hot, HOUR)
    outside_before = snapshot(node.outside)
    for args in (("scan",), ("prune", "--force"), ("verify",), ("ls", "--json"), ("status", "--json")):
        result = node.cli(*args)
        assert result.returncode in (0, 1), (args, result.stderr[-3000:])
        assert "Traceback" not in result.stderr, (args, result.stderr[-3000:])
    assert snapshot(node.outside) == outside_before
    assert all((evil / f"checkpoint-{n}").is_dir() for n in (8, 10, 11))  # not ours to delete


# -- names ----------------------------------------------------------------------------------------


def test_non_utf8_names_are_left_alone_and_nothing_crashes(tmp_path: Path) -> None:
    node = Node(tmp_path)
    hf(node.hot / "r", 1)
    hf(node.hot / "r", 2)
    odd_run = os.fsencode(node.hot) + b"/run-\xff\xfe"
    os.makedirs(odd_run + b"/checkpoint-3/nested")
    with open(odd_run + b"/checkpoint-3/trainer_state.json", "wb") as f:
        f.write(b"{}")
    odd_ckpt = os.fsencode(node.hot / "r") + b"/checkpoint-7\xff"
    os.makedirs(odd_ckpt)
    with open(odd_ckpt + b"/data\xfe.bin", "wb") as f:
        f.write(b"data")
    age_tree(node.hot, 3 * HOUR)
    for args in (("scan",), ("prune", "--force"), ("ls", "--json"), ("status",), ("verify",)):
        result = node.cli(*args)
        assert result.returncode in (0, 1), (args, result.stderr[-3000:])
        assert "Traceback" not in result.stderr, (args, result.stderr[-3000:])
    assert os.path.isdir(odd_run + b"/checkpoint-3") and os.path.isdir(
        odd_ckpt
    )  # never managed, never reaped


# -- malformed framework files: marked corrupt, the daemon keeps running ----------------------------


def test_malformed_trainer_state_marks_corrupt_and_the_daemon_keeps_running(tmp_path: Path) -> None:
    node = Node(tmp_path, {"keep_last": 5})
    run = node.hot / "r"
    hf(run, 1, state=BOMB)  # used to raise RecursionError out of every scan and prune
    hf(run, 2, state='{"global_step": 2, "log_hist')  # truncated
    hf(run, 3, state="[]")  # not an object
    hf(run, 4, state='{"global_step": 4, "log_history": [{"step": 4, "eval_loss": NaN}]}')
    hf(run, 5)
    age_tree(node.hot, 60)
    scan = node.cli("scan")
    assert scan.returncode == 0, scan.stderr[-3000:]
    states = {
        c["step"]: c["state"] for c in json.loads(node.cli("ls", "--json").stdout)["runs"][0]["checkpoints"]
    }
    assert states == {1: "corrupt", 2: "corrupt", 3: "corrupt", 4: "complete", 5: "complete"}
    log = (tmp_path / "daemon.log").open("wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTKEEPER_", "NOTIFY_SOCKET"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "daemon"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    log.close()
    try:
        deadline = time.monotonic() + 30
        text = ""
        while time.monotonic() < deadline:
            text = (tmp_path / "daemon.log").read_text(errors="replace")
            if text.count('"prune done"') >= 2:
                break
            time.sleep(0.2)
            # a new bomb while it runs: a hook line and another framework file
            if '"ready"' in text and not (run / ".ckptkeeper").exists():
                (run / ".ckptkeeper").mkdir()
                (run / ".ckptkeeper" / "commits.jsonl").write_text(
                    '{"path": "checkpoint-5", "step": 5, "time": 1.0, "metrics": ' + BOMB + "}\n"
                )
                hf(run, 6, state=BOMB)
        assert proc.poll() is None, text[-3000:]  # still running
        assert text.count('"prune done"') >= 2, text[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert "Traceback" not in (tmp_path / "daemon.log").read_text(errors="replace")


# -- config -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("max_delete = -1", "max_delete"),
        ("max_delete = 100000000000000000000000", "max_delete"),
        ("run_depth = 0", "run_depth"),
        ("run_depth = 1e9", "run_depth"),
        ('index = "/tmp/x\\u0000y"', "index"),
        ("[daemon]\nsettle_seconds = -5", "daemon.settle_seconds"),
        ('[daemon]\nretention_interval = "1e400s"', "daemon.retention_interval"),
        ("[daemon]\nretention_interval = 0", "daemon.retention_interval"),
        ("[daemon]\npolling_interval = 0", "daemon.polling_interval"),
        ('[daemon]\nrescan_interval = "1000000w"', "daemon.rescan_interval"),
        ('[daemon]\nmetrics_addr = "127.0.0.1:99999"', "daemon.metrics_addr"),
        ("[reaper]\nkeep_last_of_failed = -1", "reaper.keep_last_of_failed"),
        ("[reaper]\npartial_after = -1", "reaper.partial_after"),
    ],
)
def test_huge_negative_zero_and_nul_values_in_config_exit_2_naming_the_key(
    tmp_path: Path, line: str, key: str
) -> None:
    hot = tmp_path / "hot"
    hot.mkdir()
    tier = f'[[tiers]]\nname = "hot"\nurl = "{hot}"\n'
    if line.startswith("["):  # a table of its own, after the tiers
        text = f'index = "{tmp_path}/i.db"\n{tier}{line}\n'
    else:
        top = line if line.startswith("index") else f'index = "{tmp_path}/i.db"\n{line}'
        text = f"{top}\n{tier}"
    config = tmp_path / "c.toml"
    config.write_text(text)
    config.chmod(0o600)
    result = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "ls"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"config error: {key}:" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("tier_line", "key"),
    [
        ("keep_last = -1", "tiers[0].keep_last"),
        ("keep_last = 1000000000000000000000", "tiers[0].keep_last"),
        ("keep_every = 0", "tiers[0].keep_every"),
        ("high_watermark = 1e999", "tiers[0].high_watermark"),
        ("high_watermark = -0.5", "tiers[0].high_watermark"),
        ('keep_within = "-3d"', "tiers[0].keep_within"),
        ('url = "/nvme/\\u0000ckpt"', "tiers[0].url"),
    ],
)
def test_bad_tier_numbers_exit_2_naming_the_key(tmp_path: Path, tier_line: str, key: str) -> None:
    config = tmp_path / "c.toml"
    url = "" if tier_line.startswith("url") else f'url = "{tmp_path}"\n'
    config.write_text(f'index = "{tmp_path}/i.db"\n[[tiers]]\nname = "hot"\n{url}{tier_line}\n')
    config.chmod(0o600)
    result = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "prune", "--dry-run"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"config error: {key}:" in result.stderr, result.stderr


@pytest.mark.parametrize("mode", [0o666, 0o622, 0o602, 0o620])
def test_a_config_others_may_write_is_refused_by_every_command(tmp_path: Path, mode: int) -> None:
    node = Node(tmp_path)
    hf(node.hot / "r", 1)
    hf(node.hot / "r", 2)
    age_tree(node.hot, HOUR)
    node.config.chmod(mode)
    for args in (("prune",), ("daemon",), ("scan",)):
        result = node.cli(*args, timeout=30)
        assert result.returncode == 2, (args, result.stdout + result.stderr)
        assert "refusing a config file writable by group or others" in result.stderr
    assert len(list((node.hot / "r").iterdir())) == 2  # nothing ran


def test_a_committed_path_through_a_symlinked_directory_is_not_cataloged(tmp_path: Path) -> None:
    """The hook may commit any path under the run dir; one through ``link -> /outside`` used to be
    cataloged as a checkpoint (its outside bytes hashed), then every prune failed to move it."""
    node = Node(tmp_path)
    run = node.hot / "r"
    hf(run, 1)
    hf(run, 2)
    os.symlink(node.outside, run / "link-out")
    control = run / ".ckptkeeper"
    control.mkdir()
    (control / "commits.jsonl").write_text(
        json.dumps({"path": "link-out/precious.bin", "step": 0, "time": 1.0})
        + "\n"
        + json.dumps({"path": "link-out/sub", "step": 0, "time": 1.0})
        + "\n"
    )
    age_tree(node.hot, HOUR)
    outside_before = snapshot(node.outside)
    scan = node.cli("scan")
    assert scan.returncode == 0 and "committed path goes through a symlink; ignored" in scan.stderr
    names = {c["name"] for c in json.loads(node.cli("ls", "--json").stdout)["runs"][0]["checkpoints"]}
    assert names == {"checkpoint-1", "checkpoint-2"}
    result = node.cli("prune")
    assert result.returncode == 0, result.stdout + result.stderr
    assert snapshot(node.outside) == outside_before
