"""Disk faults (docs/design.md, safety invariant 6): a full warm tier, and a corrupt or unreadable index.

* ENOSPC while copying to warm — on a real 2 MiB tmpfs when this machine lets us mount one (root),
  and always through a fault seam in the local writer: the copy rolls back (no staging left), the
  source is untouched byte for byte, the delete that depended on it is skipped, and the log says
  why ("No space left on device").
* A corrupt index is detected at start (``Index.quick_check``), moved aside and rebuilt from the
  tiers (hot scan + the manifests beside every copy); pins are salvaged from the damaged file when
  it still reads; the first prune after the rebuild deletes and reaps nothing (exit 3, "deletes
  held"), the next one applies the policy. The daemon does the same at start.
* An index that cannot be opened at all (not corrupt: a directory, a failing disk) is left where
  it is and the daemon refuses to start: deleting nothing is the safe failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, write_config
from faultnode import GOLDEN, FaultNode, Template, kill

ENOSPC_SEAM = """
import errno, os, sys
import ckptkeeper.storage.localfs as _localfs
_write = _localfs._LocalFileWriter.write
def write(self, data):
    if self.written + len(data) > 1_000_000:  # the disk is "full" after ~1 MB of any file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    _write(self, data)
_localfs._LocalFileWriter.write = write
from ckptkeeper.cli import main
sys.exit(main())
"""


def hf(run_dir: Path, step: int, size: int) -> dict[str, str]:
    ckpt = run_dir / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    payload = os.urandom(size // 4 * 4)
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [len(payload) // 4], "data_offsets": [0, len(payload)]}}
    )
    files = {
        "model.safetensors": struct.pack("<Q", len(header)) + header.encode() + payload,
        "trainer_state.json": json.dumps({"global_step": step, "log_history": []}).encode(),
    }
    for name, data in files.items():
        (ckpt / name).write_bytes(data)
    when = time.time() - 3600 + step
    for p in [*ckpt.iterdir(), ckpt]:
        os.utime(p, (when, when))
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


class TwoTiers:
    def __init__(self, tmp: Path, warm: Path) -> None:
        self.tmp = tmp
        self.hot = tmp / "hot"
        self.warm = warm
        self.config = tmp / "config.toml"
        write_config(
            self.config,
            index=tmp / "index.db",
            daemon={"settle_seconds": "1s", "trust_mtimes": True},
            tiers=[
                local_tier("hot", self.hot, keep_last=1),
                local_tier("warm", warm, keep_last=5),
            ],
        )
        run = self.hot / "run"
        # step 1 does not fit in 2 MiB; step 2 does; step 3 stays hot
        self.hashes = {1: hf(run, 1, 3 * 2**20), 2: hf(run, 2, 100_000), 3: hf(run, 3, 100_000)}

    def cli(self, *args: str, wrapper: str | None = None) -> subprocess.CompletedProcess[str]:
        head = [sys.executable, "-c", wrapper] if wrapper else [sys.executable, "-m", "ckptkeeper.cli"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
        return subprocess.run(
            [*head, "--config", str(self.config), *args], capture_output=True, text=True, timeout=120, env=env
        )

    def intact(self, root: Path, step: int) -> bool:
        ckpt = root / "run" / f"checkpoint-{step}"
        got = (
            {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.iterdir()}
            if ckpt.is_dir()
            else {}
        )
        return got == self.hashes[step]


@pytest.fixture
def tmpfs_warm(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "warm"
    mnt.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); the fault-seam test covers ENOSPC")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def check_enospc_outcome(node: TwoTiers, result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "No space left on device" in result.stderr
    assert "data left in place" in result.stderr  # the executor's log line names the outcome
    assert "skipped: delete run/checkpoint-1 (hot): a copy it depends on failed" in result.stdout
    assert node.intact(node.hot, 1)  # the source is untouched
    assert not (node.warm / "run" / "checkpoint-1").exists()
    assert not [p for p in node.warm.rglob("*") if ".ckptkeeper-tmp" in p.name]  # rolled back
    assert node.intact(node.warm, 2) and not (node.hot / "run" / "checkpoint-2").exists()
    assert node.intact(node.hot, 3)
    ls = json.loads(node.cli("ls", "--json").stdout)
    tiers = {c["step"]: c["tiers"] for c in ls["runs"][0]["checkpoints"]}
    assert tiers == {1: ["hot"], 2: ["warm"], 3: ["hot"]}


def test_enospc_on_a_real_full_tmpfs_leaves_the_source_and_logs_why(tmp_path: Path, tmpfs_warm: Path) -> None:
    node = TwoTiers(tmp_path, tmpfs_warm)
    check_enospc_outcome(node, node.cli("prune"))
    # space freed later: the next prune completes the move
    (tmpfs_warm / "run" / "checkpoint-2" / "model.safetensors").unlink()  # make room (test only)
    subprocess.run(["mount", "-o", "remount,size=8m", str(tmpfs_warm)], check=True)
    again = node.cli("prune")
    assert "checkpoint-1" not in again.stderr or again.returncode == 0, again.stderr
    assert node.intact(tmpfs_warm, 1)


def test_enospc_through_the_fault_seam_leaves_the_source_and_logs_why(tmp_path: Path) -> None:
    warm = tmp_path / "warm-other-fs"
    warm.mkdir()
    node = TwoTiers(tmp_path, warm)
    # one filesystem would mean a rename, which writes no data: a replica tier forces real copies
    node.config.write_text(
        node.config.read_text() + f'[[tiers]]\nname = "spare"\nurl = "{tmp_path}/spare"\nreplicate = true\n'
    )
    (tmp_path / "spare").mkdir()
    result = node.cli("prune", wrapper=ENOSPC_SEAM)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "No space left on device" in result.stderr and "data left in place" in result.stderr
    assert node.intact(node.hot, 1)
    assert not [
        p for root in (warm, tmp_path / "spare") for p in root.rglob("*") if ".ckptkeeper-tmp" in p.name
    ]


# -- the index ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Template:
    return Template.build(tmp_path_factory.mktemp("small"), multipart=False)


def corrupt_pages(index: Path) -> None:
    """Damage the tail pages (a bulky journal), leaving the header and the checkpoints table
    readable: quick_check fails, pins can still be salvaged."""
    con = sqlite3.connect(index)
    con.executemany(
        "INSERT INTO journal (action, phase, detail, started_at, updated_at, done) VALUES (?, 'done', '{}', 0, 0, 1)",
        [(json.dumps({"pad": "x" * 200}),) for _ in range(3000)],
    )
    con.commit()
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    size = index.stat().st_size
    with open(index, "r+b") as f:
        f.seek(size - 4096 * 3)
        f.write(os.urandom(4096 * 2))


def files_of(node: FaultNode, s3: Any) -> set[str]:
    local = {
        str(p.relative_to(node.tmp)) for root in (node.hot, node.warm) for p in root.rglob("*") if p.is_file()
    }
    return local | {f"s3:{k}" for k in node.s3_keys(s3)}


def stricter(node: FaultNode) -> None:
    node.write_config(warm_keep_last=1)  # warm keeps only the newest: old@300..500 would expire


def test_corrupt_index_is_rebuilt_from_the_tiers_and_the_first_prune_deletes_nothing(
    small: Template, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    node = FaultNode(tmp_path, small, endpoint=s3_client.meta.endpoint_url, bucket=s3_bucket)
    assert node.cli("prune").returncode == 0
    assert node.cli("pin", "old", "400").returncode == 0
    corrupt_pages(node.index)
    stricter(node)
    before = files_of(node, s3_client)

    first = node.cli("prune")
    assert first.returncode == 3, first.stdout + first.stderr
    assert "deletes held" in first.stdout + first.stderr
    assert "index corrupt: moved aside" in first.stderr
    assert files_of(node, s3_client) >= before  # nothing deleted anywhere
    assert list(tmp_path.glob("state/index.db.corrupt-*"))
    assert node.placement() == GOLDEN  # everything cataloged again, from the tiers alone
    pinned = [(r["name"], c["step"]) for r in node.ls()["runs"] for c in r["checkpoints"] if c["pinned"]]
    assert pinned == [("old", 400)]  # salvaged from the damaged file
    assert json.loads(node.cli("status", "--json").stdout)["deletes_held"] is None  # released

    second = node.cli("prune")
    assert second.returncode == 0, second.stdout + second.stderr
    placement = node.placement()
    assert ("old", 300) not in placement or "warm" not in placement[("old", 300)]  # the policy applies again
    assert placement[("old", 400)] == ("warm",)  # pinned: kept
    assert node.lost(s3_client, [("old", 400), ("old", 600), ("train", 800), ("train", 200)]) == []


def test_garbage_index_daemon_rebuilds_at_start_holds_one_pass_and_keeps_the_pins_of_the_tiers(
    small: Template, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    """Nothing of the damaged index reads, but the pins live in the tiers too (pin objects beside
    the manifests, docs/design.md, "Many nodes"): the daemon rebuilds, its first pass only copies, and once every
    tier was listed the policy applies again — except to what was pinned."""
    node = FaultNode(tmp_path, small, endpoint=s3_client.meta.endpoint_url, bucket=s3_bucket)
    assert node.cli("prune").returncode == 0
    assert node.cli("pin", "old", "400").returncode == 0
    for suffix in ("-wal", "-shm"):
        Path(str(node.index) + suffix).unlink(missing_ok=True)
    node.index.write_bytes(os.urandom(64 * 1024))  # not a database at all
    # warm keeps only the newest; retention alone (a reap job each second competes with it for the
    # one scheduler worker, and a held pass reconciles every tier, so misfires could starve it)
    node.write_config(warm_keep_last=1, reap_interval="1h")
    pinned = node.warm / "old" / "checkpoint-400"
    expiring = node.warm / "train" / "checkpoint-500"  # no tier keeps it any more
    proc = node.popen("daemon", log="daemon")
    try:
        deadline = time.monotonic() + 60
        while expiring.exists() and time.monotonic() < deadline:
            time.sleep(0.3)
    finally:
        assert kill(proc, signal.SIGTERM) == 0, node.log("daemon")[-3000:]
    evs = events(node)
    names = [e.get("event") for e in evs]
    assert (
        "index corrupt: moved aside, rebuilding from the tiers; deletes held until a full reconcile" in names
    )
    assert names.index("index rebuilt from the tiers") < names.index("prune done")
    passes = [e for e in evs if e.get("event") == "prune done" and e.get("job") == "retention"]
    assert passes and passes[0]["exit_code"] == 3, passes  # the first pass after the rebuild: held
    assert not expiring.exists(), node.log("daemon")[-3000:]  # then the policy applies again ...
    assert pinned.is_dir()  # ... but not to the pin, read back from the tiers
    assert json.loads(node.cli("status", "--json").stdout)["deletes_held"] is None
    pins = [(r["name"], c["step"]) for r in node.ls()["runs"] for c in r["checkpoints"] if c["pinned"]]
    assert pins == [("old", 400)]
    assert node.lost(s3_client, [("old", 400), ("old", 600), ("train", 800), ("train", 200)]) == []


def events(node: FaultNode) -> list[dict[str, Any]]:
    out = []
    for line in node.log("daemon").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


def test_an_index_that_cannot_be_opened_is_left_alone_and_nothing_is_deleted(
    small: Template, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    node = FaultNode(tmp_path, small, endpoint=s3_client.meta.endpoint_url, bucket=s3_bucket)
    for made in node.index.parent.glob(node.index.name + "*"):  # the seeded node's index
        made.unlink()
    node.index.mkdir()  # "unable to open database file": not corruption, maybe a failing disk
    before = files_of(node, s3_client)
    result = node.cli("daemon", timeout=30)
    assert result.returncode == 1
    assert "cannot open index" in result.stderr
    assert node.index.is_dir() and not list(tmp_path.glob("state/index.db.corrupt-*"))
    prune = node.cli("prune")
    assert prune.returncode == 1 and "cannot open index" in prune.stderr
    assert files_of(node, s3_client) == before
