"""Per-tier compression (docs/compression.md), end to end through the CLI.

Checkpoints written by real frameworks (tests/fixtures/) are pruned from hot into a compressed
local or S3 tier and restored byte-identical; the tier's manifest records how each file is stored
while the version stays the raw content's; a damaged stored object fails verify and restore naming
the file; an old raw tier keeps restoring after compression is switched on; hostile manifests are
refused; the config refuses compression on the hot tier and without the codecs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, s3_tier, write_config
from click.testing import CliRunner

from ckptkeeper.cli import main
from ckptkeeper.core.model import MANIFEST_SUFFIX, Manifest
from ckptkeeper.storage import codec
from ckptkeeper.storage.base import VerificationError

FIXTURES = Path(__file__).parent / "fixtures"
GIB = float(1 << 30)
RUN = "run"
LAYOUTS = {
    # framework → (checkpoint name, step) of one complete save in tests/fixtures/<framework>/complete
    "hf": ("checkpoint-4", 4),
    "safetensors": ("step_100", 100),
    "dcp": ("step_100", 100),
    "lightning": ("checkpoints/epoch=1-step=4.ckpt", 4),
    "deepspeed": ("checkpoints/global_step2", 2),
    "megatron": ("checkpoints/iter_0000020", 20),
}


def _tree(root: Path) -> dict[str, str]:
    if root.is_file():
        return {"": hashlib.sha256(root.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class Node:
    """A hot tier keeping nothing and one slower tier, driven through the CLI."""

    def __init__(self, tmp: Path, slow: dict[str, Any]) -> None:
        self.tmp = tmp
        self.hot = tmp / "hot"
        self.hot.mkdir(exist_ok=True)
        self.slow = slow
        self.configure(slow)

    def configure(self, slow: dict[str, Any]) -> None:
        self.slow = slow
        self.config = write_config(
            self.tmp / "config.toml",
            index=self.tmp / "index.db",
            daemon={"settle_seconds": "1s", "trust_mtimes": True},
            tiers=[local_tier("hot", self.hot, keep_last=0), slow],
        )

    def cli(self, *args: str) -> tuple[int, str]:
        """Exit code and stdout (stderr too unless ``--json``: that stdout is one document)."""
        result = CliRunner().invoke(main, ["--config", str(self.config), *args], catch_exceptions=False)
        return result.exit_code, result.stdout if "--json" in args else result.output

    def ok(self, *args: str) -> Any:
        code, out = self.cli(*args)
        assert code == 0, out
        return json.loads(out) if "--json" in args else out

    def add_fixture(self, framework: str) -> None:
        shutil.copytree(
            FIXTURES / framework / "complete" / RUN, self.hot / RUN, symlinks=True, dirs_exist_ok=True
        )
        for keep in self.hot.rglob(".keep-empty-dir"):
            keep.unlink()
        self.backdate()

    def backdate(self) -> None:
        then = time.time() - 2 * 3600
        for p in sorted(self.hot.rglob("*"), reverse=True):
            os.utime(p, (then, then), follow_symlinks=False)


def _local(tmp: Path, compression: str) -> dict[str, Any]:
    (tmp / "warm").mkdir(exist_ok=True)
    return local_tier("warm", tmp / "warm", compression=compression, keep_last=10)


def _manifest(node: Node, name: str, run: str = RUN) -> Manifest:
    return Manifest.from_json((node.tmp / "warm" / run / f"{name}{MANIFEST_SUFFIX}").read_bytes())


@pytest.mark.parametrize("compression", ["zstd", "auto"])
@pytest.mark.parametrize("framework", sorted(LAYOUTS))
def test_framework_checkpoints_round_trip_compressed_on_a_local_tier(
    framework: str, compression: str, tmp_path: Path
) -> None:
    node = Node(tmp_path, _local(tmp_path, compression))
    node.add_fixture(framework)
    name, step = LAYOUTS[framework]
    original = _tree(node.hot / RUN / name)
    node.ok("prune", "--json")
    assert not (node.hot / RUN / name).exists(), "pruned into the slower tier"
    manifest = _manifest(node, name)
    for e in manifest.files:  # each file stored compressed where that saves 3 %, else as it is
        stored = tmp_path / "warm" / RUN / name / e.path if e.path else tmp_path / "warm" / RUN / name
        if e.encoding:
            assert stored.stat().st_size == e.stored and e.stored is not None and e.stored <= 0.97 * e.size
            assert stored.read_bytes().startswith(codec.MAGIC)
        else:
            assert hashlib.sha256(stored.read_bytes()).hexdigest() == original[e.path]
    if framework == "hf":
        assert {e.path for e in manifest.files if e.encoding} >= {"trainer_state.json", "config.json"}
    assert node.ok("verify", "--json")["problems"] == []
    node.ok("restore", RUN, "--step", str(step), "--to", str(tmp_path / "restored"))
    assert _tree(tmp_path / "restored" / name) == original


def _big_tensors(ckpt: Path) -> None:
    """A safetensors file (fp32 and bf16 tensors) and a torch.save archive, a few MiB each, as a
    trained model's weights look (small normal values): what ZipNN's byte grouping is for."""
    import torch
    from safetensors.torch import save_file

    ckpt.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weights = {
        "embed.weight": torch.randn(512, 1024, generator=g) * 0.02,
        "layer.weight": (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16),
        "step": torch.arange(10),
    }
    save_file(weights, str(ckpt / "model.safetensors"))
    torch.save({k: v.clone() for k, v in weights.items()}, ckpt / "optimizer.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 7, "log_history": []}))


def test_auto_stores_float_tensors_with_zipnn_and_saves_more_than_zstd(tmp_path: Path) -> None:
    sizes = {}
    for compression in ("zstd", "auto"):
        base = tmp_path / compression
        base.mkdir()
        node = Node(base, _local(base, compression))
        _big_tensors(node.hot / RUN / "checkpoint-7")
        original = _tree(node.hot / RUN / "checkpoint-7")
        node.backdate()
        node.ok("prune", "--json")
        manifest = _manifest(node, "checkpoint-7")
        by_path = {e.path: e for e in manifest.files}
        assert by_path["model.safetensors"].encoding == ("zipnn" if compression == "auto" else "zstd")
        sizes[compression] = by_path["model.safetensors"].stored_size + by_path["optimizer.pt"].stored_size
        node.ok("restore", RUN, "--step", "7", "--to", str(base / "restored"))
        assert _tree(base / "restored" / "checkpoint-7") == original
    assert sizes["auto"] < sizes["zstd"]


def test_compressed_tier_on_s3_round_trips(tmp_path: Path, store: tuple[str, dict[str, Any]]) -> None:
    bucket, options = store
    node = Node(tmp_path, s3_tier("cold", bucket, options["endpoint_url"], compression="auto", keep_last=10))
    _big_tensors(node.hot / "big" / "checkpoint-7")
    node.add_fixture("hf")
    originals = {(r, n): _tree(node.hot / r / n) for r, n in (("big", "checkpoint-7"), (RUN, "checkpoint-4"))}
    node.ok("prune", "--json")
    assert not (node.hot / "big" / "checkpoint-7").exists()
    assert node.ok("verify", "--json")["problems"] == []
    for (run, name), tree in originals.items():
        step = name.split("-")[1]
        node.ok("restore", run, "--step", step, "--to", str(tmp_path / f"restored-{step}"))
        assert _tree(tmp_path / f"restored-{step}" / name) == tree


def test_a_damaged_stored_object_fails_verify_and_restore_naming_the_file(tmp_path: Path) -> None:
    node = Node(tmp_path, _local(tmp_path, "auto"))
    _big_tensors(node.hot / RUN / "checkpoint-7")
    node.backdate()
    node.ok("prune", "--json")
    stored = tmp_path / "warm" / RUN / "checkpoint-7" / "model.safetensors"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only decoding and the raw hash can tell
    stored.write_bytes(bytes(data))
    code, out = node.cli("verify", "--json")
    assert code == 1, out
    problems = json.loads(out)["problems"]
    assert any("model.safetensors" in p["problem"] for p in problems), problems
    code, out = node.cli("restore", RUN, "--step", "7", "--to", str(tmp_path / "restored"))
    assert code != 0 and "model.safetensors" in out, out
    assert not (tmp_path / "restored" / "checkpoint-7").exists()
    code, out = node.cli("scrub", "--tier", "warm", "--json")
    bad = json.loads(out)["bad"]
    assert [b["name"] for b in bad] == ["checkpoint-7"] and "model.safetensors" in bad[0]["problem"], out


def test_an_old_raw_tier_restores_after_compression_is_switched_on(tmp_path: Path) -> None:
    node = Node(tmp_path, _local(tmp_path, "none"))
    node.add_fixture("hf")
    old = _tree(node.hot / RUN / "checkpoint-4")
    node.ok("prune", "--json")
    assert not any(e.encoding for e in _manifest(node, "checkpoint-4").files)
    raw_manifest = (tmp_path / "warm" / RUN / f"checkpoint-4{MANIFEST_SUFFIX}").read_text()
    assert '"encoding"' not in raw_manifest and '"stored"' not in raw_manifest

    node.configure(_local(tmp_path, "auto"))
    _big_tensors(node.hot / "big" / "checkpoint-7")
    new = _tree(node.hot / "big" / "checkpoint-7")
    node.backdate()
    node.ok("prune", "--json")
    assert not any(e.encoding for e in _manifest(node, "checkpoint-4").files), "old copies stay as they are"
    assert any(e.encoding for e in _manifest(node, "checkpoint-7", "big").files), "new copies are compressed"
    node.ok("restore", RUN, "--step", "4", "--to", str(tmp_path / "r4"))
    node.ok("restore", "big", "--step", "7", "--to", str(tmp_path / "r7"))
    assert _tree(tmp_path / "r4" / "checkpoint-4") == old
    assert _tree(tmp_path / "r7" / "checkpoint-7") == new
    # and switched off again: compressed copies still read
    node.configure(_local(tmp_path, "none"))
    node.ok("restore", "big", "--step", "7", "--to", str(tmp_path / "r7b"))
    assert _tree(tmp_path / "r7b" / "checkpoint-7") == new
    assert node.ok("verify", "--json")["problems"] == []


def test_compressed_and_raw_copies_of_one_checkpoint_are_one_version(tmp_path: Path) -> None:
    node = Node(tmp_path, _local(tmp_path, "zstd"))
    node.add_fixture("hf")
    node.ok("scan", "--json")
    before = {c["name"]: c.get("version") for r in node.ok("ls", "--json")["runs"] for c in r["checkpoints"]}
    node.ok("prune", "--json")
    manifest = _manifest(node, "checkpoint-4")
    raw = Manifest.from_json(manifest.to_json())
    stripped = json.loads(manifest.to_json())
    for f in stripped["files"]:
        f.pop("encoding", None)
        f.pop("stored", None)
    stripped.pop("digest")
    assert Manifest.from_json(json.dumps(stripped)).digest == raw.digest
    after = {c["name"]: c.get("version") for r in node.ok("ls", "--json")["runs"] for c in r["checkpoints"]}
    assert after["checkpoint-4"] == before["checkpoint-4"] is not None


def test_ls_text_shows_stored_bytes_and_the_saving_of_a_compressed_copy(tmp_path: Path) -> None:
    from ckptkeeper.util.fmt import human_bytes

    node = Node(tmp_path, _local(tmp_path, "zstd"))
    node.add_fixture("hf")
    node.ok("prune", "--json")
    (ckpt,) = node.ok("ls", "--json")["runs"][0]["checkpoints"]
    raw, stored = ckpt["bytes"], ckpt["stored_bytes"]["warm"]
    assert stored < raw
    text = node.ok("ls")
    assert "STORED" in text.splitlines()[1]
    saving = 100.0 * (raw - stored) / raw
    assert f"{human_bytes(raw)}  warm: {human_bytes(stored)} (-{saving:.1f} %)" in text, text
    # a tier storing copies as they are: no column
    plain = tmp_path / "plain"
    plain.mkdir()
    node = Node(plain, _local(plain, "none"))
    node.add_fixture("hf")
    node.ok("prune", "--json")
    assert "STORED" not in node.ok("ls") and "SIZE" in node.ok("ls")


def test_dry_run_prices_copies_into_a_compressed_tier_at_the_stored_bytes_its_copies_achieved(
    tmp_path: Path,
) -> None:
    price = 1_000_000.0  # per GiB-month: a few KiB cost more than a cent
    node = Node(tmp_path, {**_local(tmp_path, "zstd"), "cost_per_gib_month": price})
    node.add_fixture("hf")
    first = node.ok("prune", "--dry-run", "--json")  # no copy into warm yet: priced at raw bytes
    assert first["stored_estimate"] is None
    copied = sum(a["bytes"] for a in first["actions"] if a["action"] == "copy" and a["to_tier"] == "warm")
    assert first["cost_saving_per_month"]["tiers"]["warm"] == pytest.approx(-round(copied / GIB * price, 4))
    node.ok("prune", "--json")
    history = [c for r in node.ok("ls", "--json")["runs"] for c in r["checkpoints"] if "warm" in c["tiers"]]
    raw, stored = sum(c["bytes"] for c in history), sum(c["stored_bytes"]["warm"] for c in history)
    assert stored < raw

    shutil.copytree(FIXTURES / "hf" / "complete" / RUN, node.hot / "run2")  # the next run's saves
    node.backdate()
    doc = node.ok("prune", "--dry-run", "--json")
    copied = sum(a["bytes"] for a in doc["actions"] if a["action"] == "copy" and a["to_tier"] == "warm")
    assert copied > 0
    estimate = doc["stored_estimate"]["warm"]
    assert estimate["copy_bytes"] == copied  # the actions keep their raw bytes
    assert estimate["estimated_stored_bytes"] == round(copied * stored / raw) < copied
    assert estimate["stored_per_raw"] == round(stored / raw, 4) and estimate["from_copies"] == len(history)
    saving = doc["cost_saving_per_month"]["tiers"]["warm"]
    assert saving == pytest.approx(-round(estimate["estimated_stored_bytes"] / GIB * price, 4))
    text = node.ok("prune", "--dry-run")
    from ckptkeeper.util.fmt import human_bytes

    assert (
        f"would copy {human_bytes(copied)} into warm, stored as "
        f"~{human_bytes(estimate['estimated_stored_bytes'])} (estimate: {100 * stored / raw:.1f} % of raw"
    ) in text, text
    assert "per month in storage (warm " in text and "; copies at their estimated stored bytes)" in text


def test_dry_run_prices_the_delete_of_a_compressed_copy_at_the_bytes_it_takes(tmp_path: Path) -> None:
    price = 1_000_000.0
    node = Node(tmp_path, {**_local(tmp_path, "zstd"), "cost_per_gib_month": price})
    shutil.copytree(FIXTURES / "hf" / "complete" / RUN, node.hot / RUN)
    then = time.time() - 3600  # settled, not stale: both saves go to warm
    for p in sorted(node.hot.rglob("*"), reverse=True):
        os.utime(p, (then, then), follow_symlinks=False)
    node.ok("prune", "--json")
    stored = {c["step"]: c["stored_bytes"]["warm"] for c in node.ok("ls", "--json")["runs"][0]["checkpoints"]}
    node.configure({**_local(tmp_path, "zstd"), "cost_per_gib_month": price, "keep_last": 1})
    doc = node.ok("prune", "--dry-run", "--json")
    (delete,) = doc["actions"]
    assert (delete["action"], delete["step"], delete["tier"]) == ("delete", 2, "warm")
    assert stored[2] < delete["bytes"]  # the action keeps the raw bytes
    saving = doc["cost_saving_per_month"]["tiers"]["warm"]
    assert saving == pytest.approx(round(stored[2] / GIB * price, 4))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"encoding": "brotli", "stored": 10}, "unknown encoding 'brotli'"),
        ({"encoding": "zstd", "stored": 10**15}, "stored bytes for a file of"),
        ({"encoding": "zstd"}, "files[0].stored"),
        ({"encoding": 7, "stored": 10}, "files[0].encoding"),
        ({"stored": 10}, "given for a file stored raw"),
    ],
)
def test_hostile_manifests_are_refused_with_the_field(change: dict[str, Any], message: str) -> None:
    doc = {
        "version": 1,
        "run": "r",
        "step": 1,
        "name": "c",
        "layout": "x",
        "is_dir": True,
        "files": [{"path": "a", "size": 100, "hash": "00"} | change],
    }
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Manifest.from_json(json.dumps(doc))


def test_a_copy_with_an_unknown_encoding_is_quarantined_not_read(tmp_path: Path) -> None:
    node = Node(tmp_path, _local(tmp_path, "zstd"))
    node.add_fixture("hf")
    node.ok("prune", "--json")
    path = tmp_path / "warm" / RUN / f"checkpoint-4{MANIFEST_SUFFIX}"
    doc = json.loads(path.read_text())
    for f in doc["files"]:
        if "encoding" in f:
            f["encoding"] = "zstd-v9"
    path.write_text(json.dumps(doc))
    result = CliRunner().invoke(main, ["--config", str(node.config), "scan", "--json"])
    assert json.loads(result.stdout)["quarantined"] == 1, result.output
    assert "unknown encoding 'zstd-v9'" in result.output
    code, _ = node.cli("restore", RUN, "--step", "4", "--to", str(tmp_path / "restored"))
    assert code != 0
    assert not (tmp_path / "restored" / "checkpoint-4").exists()


def test_config_refuses_compression_on_the_hot_tier_and_without_the_codecs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(
        tmp_path / "c.toml",
        index=tmp_path / "i.db",
        tiers=[local_tier("hot", tmp_path / "hot", compression="zstd"), _local(tmp_path, "none")],
    )
    (tmp_path / "hot").mkdir()
    result = CliRunner().invoke(main, ["--config", str(config), "status"])
    assert result.exit_code == 2 and "tiers[0].compression" in result.output, result.output

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "zipnn" else real(name, *a)
    )
    config = write_config(
        tmp_path / "c.toml",
        index=tmp_path / "i.db",
        tiers=[local_tier("hot", tmp_path / "hot"), _local(tmp_path, "auto")],
    )
    result = CliRunner().invoke(main, ["--config", str(config), "status"])
    assert result.exit_code == 2, result.output
    assert "tiers[1].compression" in result.output and "compress extra" in result.output


# -- kill -9 at every crash point of a compressed copy and delete ----------------------------------


def _prune_killed_at(node: Node, k: int | None, spool: Path) -> int:
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(spool), "PYTHONPATH": str(Path(__file__).parent.parent)}
    env.pop("CKPTKEEPER_TEST_CRASH_AFTER", None)
    if k is not None:
        env["CKPTKEEPER_TEST_CRASH_AFTER"] = str(k)
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "prune", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode


def _listing(node: Node, where: str) -> set[str]:
    """Paths in the slower tier, relative to its root (S3: keys under the prefix)."""
    if where == "local":
        root = node.tmp / "warm"
        return {str(p.relative_to(root)) for p in root.rglob("*")}
    import boto3

    options = node.slow["storage_options"]
    bucket, prefix = node.slow["url"].removeprefix("s3://").split("/", 1)
    client = boto3.client(
        "s3", endpoint_url=options["endpoint_url"], aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    )  # fmt: skip
    objs = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"][len(prefix) + 1 :] for o in objs}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_kill_9_at_every_crash_point_of_a_compressed_copy_loses_nothing_and_leaves_nothing(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    import signal

    import boto3

    from ckptkeeper.hook.protocol import STAGING_MARK

    template = tmp_path / "template"
    _big_tensors(template / "big" / "checkpoint-7")
    shutil.copytree(FIXTURES / "hf" / "complete" / RUN / "checkpoint-4", template / RUN / "checkpoint-4")
    originals = {(r, n): _tree(template / r / n) for r, n in (("big", "checkpoint-7"), (RUN, "checkpoint-4"))}
    k, trials = 1, 0
    while True:
        base = tmp_path / f"trial-{k}"
        base.mkdir()
        if where == "s3":
            endpoint = request.getfixturevalue("s3_reset")
            bucket = f"crash-{k}"
            boto3.client(
                "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                region_name="us-east-1",
            ).create_bucket(Bucket=bucket)  # fmt: skip
            node = Node(base, s3_tier("warm", bucket, endpoint, compression="auto", keep_last=10))
        else:
            node = Node(base, _local(base, "auto"))
        shutil.copytree(template, node.hot, dirs_exist_ok=True)
        node.backdate()
        spool = base / "spool"
        spool.mkdir()
        code = _prune_killed_at(node, k, spool)
        if code != -signal.SIGKILL:
            assert code == 0 and trials > 5, f"prune exited {code} at crash point {k}"
            break
        trials += 1
        warm = _listing(node, where)
        for (run, name), tree in originals.items():  # right after the kill: nothing lost
            in_hot = (node.hot / run / name).exists() and _tree(node.hot / run / name) == tree
            committed = f"{run}/{name}{MANIFEST_SUFFIX}" in warm
            assert in_hot or committed, f"{run}/{name} lost at crash point {k}"
        assert list(spool.iterdir()) == [], "no spool file outlives the process"
        assert not [p for p in warm if "ckptkeeper-spool" in p], "nor in the tier (a local tier's spool)"
        assert _prune_killed_at(node, None, spool) == 0, f"the next prune after crash point {k}"
        leftovers = [p for p in _listing(node, where) if STAGING_MARK in p or ".ckptkeeper-staging" in p]
        assert leftovers == [], f"staging left after crash point {k}: {leftovers}"
        if where == "s3":
            uploads = boto3.client(
                "s3", endpoint_url=node.slow["storage_options"]["endpoint_url"], aws_access_key_id="testing",
                aws_secret_access_key="testing", region_name="us-east-1",
            ).list_multipart_uploads(Bucket=node.slow["url"].split("/")[2])  # fmt: skip
            assert uploads.get("Uploads", []) == [], f"multipart uploads left after crash point {k}"
        for (run, name), tree in originals.items():
            assert not (node.hot / run / name).exists(), "moved on by the next prune"
            step = name.split("-")[1]
            node.ok("restore", run, "--step", step, "--to", str(base / f"r-{step}"))
            assert _tree(base / f"r-{step}" / name) == tree, f"{run}/{name} after crash point {k}"
        shutil.rmtree(base)
        # every early (journal) point, then every fifth (S3: fortieth) chunk of the copies
        k += 1 if k < 8 else (5 if where == "local" else 40)


def test_prune_status_and_ls_show_raw_and_stored_bytes(tmp_path: Path) -> None:
    node = Node(tmp_path, {**_local(tmp_path, "auto"), "cost_per_gib_month": 1.0})
    _big_tensors(node.hot / "big" / "checkpoint-7")
    node.backdate()
    doc = node.ok("prune", "--json")
    [copy] = doc["result"]["compressed"]
    assert copy["action"]["path"] == "big/checkpoint-7" and copy["action"]["to_tier"] == "warm"
    manifest = _manifest(node, "checkpoint-7", "big")
    assert copy["raw_bytes"] == manifest.total_bytes
    assert copy["stored_bytes"] == manifest.stored_bytes < manifest.total_bytes
    assert copy["compress_cpu_seconds"] > 0 and copy["files_compressed"] >= 2

    status = node.ok("status", "--json")
    warm = next(t for t in status["tiers"] if t["name"] == "warm")
    assert warm["bytes"] == manifest.total_bytes
    assert warm["stored_bytes"] == manifest.stored_bytes
    assert warm["saving_bytes"] == manifest.total_bytes - manifest.stored_bytes
    assert status["cost_per_month"]["tiers"]["warm"] == round(manifest.stored_bytes / 2**30, 4)
    assert "compressed tier warm:" in node.ok("status")

    [ckpt] = [c for r in node.ok("ls", "--json")["runs"] for c in r["checkpoints"]]
    assert ckpt["bytes"] == manifest.total_bytes and ckpt["stored_bytes"] == {"warm": manifest.stored_bytes}
    # a fresh index rebuilt from the tier's manifests knows the stored bytes too
    (tmp_path / "index.db").unlink()
    node.ok("scan", "--json")
    [ckpt] = [c for r in node.ok("ls", "--json")["runs"] for c in r["checkpoints"]]
    assert ckpt["stored_bytes"] == {"warm": manifest.stored_bytes}


def test_the_compression_bench_runs_on_checkpoints_it_trains(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.compression",
            "--vocab",
            "2000",
            "--dim",
            "64",
            "--layers",
            "2",
            "--steps",
            "2",
            "--json",
        ],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["checkpoint"] for r in rows] == [
        "HF fp32 + Adam",
        "DCP fp32 + Adam",
        "the same, saved again",
        "HF pure bf16",
        "half frozen fp32",
        "LoRA adapter",
    ]
    for r in rows:
        assert r["none"]["stored_bytes"] == r["raw_bytes"]
        assert r["auto"]["stored_bytes"] < r["zstd"]["stored_bytes"] < r["raw_bytes"]


@pytest.mark.parametrize("dtype", [None, "?", "float32", "bfloat16"])
def test_every_frame_round_trips_whatever_its_length_and_bytes(dtype: str | None) -> None:
    """Odd lengths (ZipNN corrupts the heap on a length that is not whole elements), random bytes
    (every codec loses: the frame is stored raw, after ZipNN rewrote its own copy of the input),
    float tensors; decoded through the reader a restore uses."""
    import io
    import random

    import numpy as np

    rng = random.Random(3)
    for n in (0, 1, 4095, 4099, 100001, 131072, codec.FRAME_BYTES - 2, codec.FRAME_BYTES):
        for kind in ("random", "floats"):
            raw = (
                os.urandom(n)
                if kind == "random"
                else (np.random.default_rng(rng.randrange(99)).standard_normal(n // 4 + 1) * 0.02)
                .astype(np.float32)
                .tobytes()[:n]
            )
            original = bytes(raw)
            frame = codec.encode_frame(raw, dtype) if n else b""
            assert raw == original, "the input is never rewritten"
            stored = codec.MAGIC + frame
            reader = codec.DecodingReader(io.BytesIO(stored), len(stored), "x")
            parts = []
            while chunk := reader.read(65536):
                parts.append(bytes(chunk))
            assert b"".join(parts) == original, (n, kind, dtype)


def test_a_damaged_frame_is_reported_before_any_codec_reads_it() -> None:
    import io

    import numpy as np

    raw = (np.random.default_rng(0).standard_normal(2**20) * 0.02).astype(np.float32).tobytes()
    stored = bytearray(codec.MAGIC + codec.encode_frame(raw, "float32"))
    for at in (len(codec.MAGIC) + 20, len(stored) - 1):  # the payload's first and last byte
        damaged = bytearray(stored)
        damaged[at] ^= 0x01
        reader = codec.DecodingReader(io.BytesIO(bytes(damaged)), len(damaged), "tier:run/ckpt/model.bin")
        with pytest.raises(VerificationError, match=r"tier:run/ckpt/model\.bin: stored bytes do not decode"):
            reader.read(1)
    reader = codec.DecodingReader(io.BytesIO(bytes(stored[:-5])), len(stored), "x")
    with pytest.raises(VerificationError, match=r"frame header out of bounds|cut short"):
        reader.read(1)


def _storage_manifest(root: Path, run: str, name: str) -> Manifest:
    from ckptkeeper.core.model import FileEntry
    from ckptkeeper.util import hashing

    path = root / run / name
    files = []
    for p in sorted(path.rglob("*")):
        if p.is_file():
            size, digest = hashing.hash_file(p)
            files.append(FileEntry(str(p.relative_to(path)), size, digest))
    return Manifest(run=run, step=7, name=name, layout="hf", is_dir=True, files=tuple(files))


def test_a_compressed_copy_in_the_s3_trash_is_whole_and_undeletes(
    tmp_path: Path, s3_bucket: str, s3_storage_options: dict[str, Any]
) -> None:
    """Journal recovery decides from ``probe_aside`` with the index's manifest (raw sizes): a
    compressed copy moved aside must read as whole, or recovery would purge the only copy."""
    from ckptkeeper.core.model import TierPolicy, TierSpec
    from ckptkeeper.storage import TierStorage
    from ckptkeeper.storage.trash import new_entry

    _big_tensors(tmp_path / "hot" / "big" / "checkpoint-7")
    original = _tree(tmp_path / "hot" / "big" / "checkpoint-7")
    manifest = _storage_manifest(tmp_path / "hot", "big", "checkpoint-7")
    hot = TierStorage(TierSpec("hot", str(tmp_path / "hot"), TierPolicy()), hot=True)
    cold = TierStorage(
        TierSpec(
            "cold",
            f"s3://{s3_bucket}/ckpt",
            TierPolicy(),
            storage_options=s3_storage_options,
            compression="auto",
        )
    )
    stats = cold.copy_from(hot, manifest).stats
    assert stats is not None and stats.stored_bytes < manifest.total_bytes
    entry = new_entry(time.time())
    cold.move_aside(manifest, entry)
    assert cold.probe_aside(manifest, entry) == (True, False)
    [(listed, moved, _, why)] = cold.list_trash()
    assert listed == entry and why is None and moved is not None
    cold.undelete(manifest, entry)
    assert cold.verify(manifest) == [] and cold.list_trash() == []
    cold.fetch(manifest, tmp_path / "restored")
    assert _tree(tmp_path / "restored" / "checkpoint-7") == original


_NO_TORCH_CLI = """
import json, sys
from ckptkeeper.cli import main
try:
    main(sys.argv[2:], standalone_mode=False)
finally:
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "zipnn", "numpy"))
    with open(sys.argv[1], "w") as f:
        json.dump(loaded, f)
"""


def _frame_kinds(stored: bytes) -> set[int]:
    """The kinds of the frames of one stored file in ckptkeeper's compressed format."""
    assert stored.startswith(codec.MAGIC)
    kinds, pos = set(), len(codec.MAGIC)
    while pos < len(stored):
        kind, _, stored_len, _ = struct.unpack_from("<BIII", stored, pos)
        kinds.add(kind)
        pos += 13 + stored_len
    return kinds


def test_auto_compresses_and_restores_without_importing_torch(tmp_path: Path) -> None:
    """The ``zipnn`` package imports torch (over a CPU-second per process): a prune into an
    ``auto`` tier and a restore from it drive zipnn's C core alone, and round-trip byte-identical."""
    import subprocess
    import sys

    node = Node(tmp_path, _local(tmp_path, "auto"))
    _big_tensors(node.hot / RUN / "checkpoint-7")
    original = _tree(node.hot / RUN / "checkpoint-7")
    node.backdate()
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    for i, args in enumerate(
        (["prune"], ["restore", RUN, "--step", "7", "--to", str(tmp_path / "restored")])
    ):
        loaded = tmp_path / f"modules-{i}.json"
        argv = [sys.executable, "-c", _NO_TORCH_CLI, str(loaded), "--config", str(node.config), *args]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert [m for m in json.loads(loaded.read_text()) if not m.startswith("numpy")] == [], args
    by_path = {e.path: e for e in _manifest(node, "checkpoint-7").files}
    assert by_path["model.safetensors"].encoding == "zipnn"
    stored = (tmp_path / "warm" / RUN / "checkpoint-7" / "model.safetensors").read_bytes()
    assert codec.ZIPNN in _frame_kinds(stored), "the float tensors went through ZipNN"
    assert _tree(tmp_path / "restored" / "checkpoint-7") == original


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_zipnn_frames_are_the_zipnn_packages_own_bytes(dtype: str) -> None:
    """ZipNN frames written through zipnn's C core are byte for byte what ``zipnn.ZipNN`` writes,
    and frames ``zipnn.ZipNN`` wrote (an older ckptkeeper's) decode: stored copies stay readable
    whichever path wrote them."""
    import numpy as np
    import zipnn

    z = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
    rng = np.random.default_rng(5)
    for raw in (
        (rng.standard_normal(2**20) * 0.02).astype(np.float32).tobytes(),
        os.urandom(2**19) + bytes(2**19),
        bytes(8192),
    ):
        theirs = bytes([codec._DTYPE_CODES[dtype]]) + bytes(z.compress(bytearray(raw)))
        assert codec._zipnn_compress(raw, dtype) == theirs
        assert bytes(codec.decode_frame(codec.ZIPNN, theirs, len(raw))) == raw
        with pytest.raises(ValueError, match="not a ZipNN buffer"):
            codec.decode_frame(codec.ZIPNN, theirs, len(raw) + 4)


def test_a_small_torch_save_of_floats_goes_to_zipnn_whatever_its_length(tmp_path: Path) -> None:
    """A LoRA adapter's optimizer state: a ``torch.save`` archive of a few hundred KiB, whose
    length (a zip's) is not a multiple of 4. Its floats go to ZipNN (all but a tail of 1-3 bytes),
    not to zstd alone, and it restores byte-identical."""
    import torch

    node = Node(tmp_path, _local(tmp_path, "auto"))
    ckpt = node.hot / RUN / "checkpoint-7"
    ckpt.mkdir(parents=True)
    g = torch.Generator().manual_seed(4)
    state = {i: {"exp_avg": torch.randn(768, 16, generator=g) * 1e-3} for i in range(8)}
    torch.save({"state": state, "param_groups": [{"lr": 1e-4}]}, ckpt / "optimizer.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 7, "log_history": []}))
    size = (ckpt / "optimizer.pt").stat().st_size
    assert 64 * 1024 < size < codec.FRAME_BYTES and size % 4, size
    original = _tree(ckpt)
    node.backdate()
    node.ok("prune", "--json")
    entry = {e.path: e for e in _manifest(node, "checkpoint-7").files}["optimizer.pt"]
    stored = (tmp_path / "warm" / RUN / "checkpoint-7" / "optimizer.pt").read_bytes()
    assert entry.encoding == "zipnn" and codec.ZIPNN in _frame_kinds(stored)
    node.ok("restore", RUN, "--step", "7", "--to", str(tmp_path / "restored"))
    assert _tree(tmp_path / "restored" / "checkpoint-7") == original


def test_a_torch_save_archive_is_compressed_tensor_by_tensor(tmp_path: Path) -> None:
    """A LoRA adapter's optimizer state: hundreds of small tensors, Adam's two moments in turn,
    whose exponents differ. Each member of the ``torch.save`` zip is framed on its own, so no
    ZipNN frame mixes the two: it stores less than ZipNN over the archive as one stream, and
    restores byte-identical."""
    import torch

    node = Node(tmp_path, _local(tmp_path, "auto"))
    ckpt = node.hot / RUN / "checkpoint-7"
    ckpt.mkdir(parents=True)
    g = torch.Generator().manual_seed(6)
    state = {
        i: {
            "step": torch.tensor(40.0),
            "exp_avg": torch.randn(768, 16, generator=g) * 1e-3,
            "exp_avg_sq": (torch.randn(768, 16, generator=g) * 1e-3) ** 2 + 1e-9,
        }
        for i in range(40)
    }
    torch.save({"state": state, "param_groups": [{"lr": 1e-4}]}, ckpt / "optimizer.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 7, "log_history": []}))
    raw = (ckpt / "optimizer.pt").read_bytes()
    one_stream = len(codec.MAGIC) + sum(
        len(codec.encode_frame(raw[a:b], d)) for a, b, d in codec.frames_of(codec.plan("auto", len(raw), raw))
    )
    original = _tree(ckpt)
    node.backdate()
    node.ok("prune", "--json")
    entry = {e.path: e for e in _manifest(node, "checkpoint-7").files}["optimizer.pt"]
    assert entry.encoding == "zipnn" and entry.stored_size < 0.97 * one_stream, (
        entry.stored_size,
        one_stream,
    )
    node.ok("restore", RUN, "--step", "7", "--to", str(tmp_path / "restored"))
    assert _tree(tmp_path / "restored" / "checkpoint-7") == original


def test_zip_regions_cover_the_file_or_give_up_on_a_damaged_archive(tmp_path: Path) -> None:
    """Whatever is cut off or flipped in a ``torch.save`` archive, the plan covers the file in
    order or is None (the whole file is then tried per frame): a plan never decides what is
    stored, only how well it compresses."""
    import random

    import torch

    torch.save({"a": torch.randn(64, 64), "b": torch.arange(5000), "c": torch.randn(3)}, tmp_path / "x.pt")
    raw = (tmp_path / "x.pt").read_bytes()
    regions = codec.zip_regions(len(raw), lambda o, n: raw[o : o + n])
    assert regions is not None and "?" in {r.dtype for r in regions}
    rng = random.Random(7)
    for _ in range(300):
        data = bytearray(raw)
        if rng.random() < 0.5:
            data = data[: rng.randrange(len(data))]
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        blob = bytes(data)

        def read_at(offset: int, n: int, blob: bytes = blob) -> bytes:
            return blob[offset : offset + n]

        got = codec.zip_regions(len(blob), read_at)
        if got is not None:
            assert got[0].start == 0 and got[-1].end == len(blob)
            assert all(a.end == b.start and a.start < a.end for a, b in itertools.pairwise(got))


def test_without_the_known_zipnn_core_the_package_writes_and_reads_the_same_frames(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another zipnn release than the one whose C core ckptkeeper drives: frames go through
    ``zipnn.ZipNN``, byte for byte the same, and either path reads the other's."""
    import numpy as np

    raw = (np.random.default_rng(8).standard_normal(2**18) * 0.02).astype(np.float32).tobytes()
    direct = codec.encode_frame(raw, "float32")
    monkeypatch.setattr(codec, "_zipnn_core_module", [None])
    assert codec._zipnn_core() is None
    through_package = codec.encode_frame(raw, "float32")
    assert through_package == direct
    kind = direct[0]
    assert kind == codec.ZIPNN
    assert bytes(codec.decode_frame(kind, direct[13:], len(raw))) == raw


class _FaultySink:
    """A tier's own sink, wrapped: the file at ``fail`` fails once its first bytes are stored; the
    file at ``hold`` finishes only once the copy has opened the file after it (``opened``)."""

    def __init__(self, inner: Any, fail: str | None, hold: str | None, opened: threading.Event) -> None:
        self.inner, self.fail, self.hold, self.opened = inner, fail, hold, opened

    def open_file(self, entry: Any, source: Any = None) -> Any:
        return _FaultyWriter(self, entry.path, self.inner.open_file(entry, source))

    def commit(self, manifest: Manifest) -> None:
        self.inner.commit(manifest)

    def abort(self) -> None:
        self.inner.abort()


class _FaultyWriter:
    def __init__(self, sink: _FaultySink, path: str, inner: Any) -> None:
        self.sink, self.path, self.inner = sink, path, inner

    def write(self, data: Any, /) -> None:
        self.inner.write(data)
        if self.path == self.sink.fail:
            raise OSError(f"injected storage failure of {self.path}")

    def finish(self) -> None:
        if self.path == self.sink.hold and not self.sink.opened.wait(timeout=60):
            raise AssertionError(f"{self.path}: the copy waited for it to be stored before reading on")
        self.inner.finish()


def _faulty_node(
    tmp_path: Path, request: pytest.FixtureRequest, where: str, monkeypatch: pytest.MonkeyPatch, **fault: str
) -> tuple[Node, Any]:
    """A node whose compressed tier (local or moto) stores through :class:`_FaultySink`, and a
    boto3 client of its bucket (None for local)."""
    from ckptkeeper.storage import compressed

    opened = threading.Event()
    real_init, real_open = compressed.EncodingSink.__init__, compressed.EncodingSink.open_file

    def init(self: Any, inner: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, _FaultySink(inner, fault.get("fail"), fault.get("hold"), opened), *args, **kwargs)

    def open_file(self: Any, entry: Any, source: Any = None) -> Any:
        if entry.path == fault.get("then"):
            opened.set()
        return real_open(self, entry, source)

    monkeypatch.setattr(compressed.EncodingSink, "__init__", init)
    monkeypatch.setattr(compressed.EncodingSink, "open_file", open_file)
    if where == "local":
        return Node(tmp_path, _local(tmp_path, "auto")), None
    s3 = request.getfixturevalue("s3_client")
    s3.create_bucket(Bucket="cold")
    endpoint = s3.meta.endpoint_url
    return Node(tmp_path, s3_tier("cold", "cold", endpoint, compression="auto", keep_last=10)), s3


@pytest.mark.parametrize("where", ["local", "moto"])
def test_the_next_file_is_read_and_compressed_while_the_last_one_is_stored(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    node, _ = _faulty_node(
        tmp_path, request, where, monkeypatch, hold="model.safetensors", then="optimizer.pt"
    )
    _big_tensors(node.hot / RUN / "checkpoint-7")
    (node.hot / RUN / "checkpoint-7" / "rng_state.pth").write_bytes(os.urandom(3 << 20))  # stored raw
    node.backdate()
    original = _tree(node.hot / RUN / "checkpoint-7")
    node.ok("prune", "--json")
    assert not (node.hot / RUN / "checkpoint-7").exists()
    assert node.ok("verify", "--json")["problems"] == []
    node.ok("restore", RUN, "--step", "7", "--to", str(tmp_path / "restored"))
    assert _tree(tmp_path / "restored" / "checkpoint-7") == original


@pytest.mark.parametrize("failing", ["model.safetensors", "trainer_state.json"])
@pytest.mark.parametrize("where", ["local", "moto"])
def test_a_file_that_fails_to_store_fails_the_copy_and_leaves_nothing(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, where: str, failing: str
) -> None:
    node, s3 = _faulty_node(tmp_path, request, where, monkeypatch, fail=failing)
    _big_tensors(node.hot / RUN / "checkpoint-7")
    node.backdate()
    original = _tree(node.hot / RUN / "checkpoint-7")
    code, out = node.cli("prune", "--json")
    assert code == 1, out
    assert f"injected storage failure of {failing}" in json.dumps(json.loads(out)), out
    assert _tree(node.hot / RUN / "checkpoint-7") == original  # hot keeps the only copy
    if s3 is None:
        assert [p for p in (tmp_path / "warm").rglob("*") if p.is_file()] == []
    else:
        assert s3.list_objects_v2(Bucket="cold").get("Contents", []) == []
        assert s3.list_multipart_uploads(Bucket="cold").get("Uploads", []) == []
