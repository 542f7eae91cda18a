"""The benchmark harness (bench/, issue 8) still runs: the tiniest configuration of a few
benchmarks produces the table. No timing is asserted: these machines are shared and noisy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _run_tiny(only: str, out: Path, disk: Path, fast: Path) -> dict[str, Any]:
    """``python -m bench --tiny --only ONLY``: its JSON document, which must list no error (exit 1
    is a target missed: still a table)."""
    argv = [sys.executable, "-m", "bench", "--tiny", "--only", only, "--json", str(out)]
    argv += ["--disk-dir", str(disk), "--fast-dir", str(fast)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(out.read_text())
    assert not doc["errors"], doc["errors"]
    return doc


def test_tiny_bench_prints_one_table(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--tiny",
            "--only",
            "planning,campaign,hook_latency,daemon_idle",
            "--json",
            str(out),
            "--disk-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a target missed, still a table
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| metric"))
    assert [c.strip() for c in lines[header].split("|")[1:-1]] == [
        "metric",
        "baseline",
        "ckptkeeper",
        "ratio",
        "target",
        "result",
    ]
    body = [line for line in lines[header + 2 :] if line.startswith("|")]
    metrics = " ".join(body)
    assert "plan() 10k checkpoints" in metrics
    assert "campaign" in metrics
    assert "run.commit()" in metrics and "visible in the daemon's index" in metrics
    assert "CPU per retention pass" in metrics and "CPU per reap pass" in metrics  # hookless rows
    assert "(error)" not in metrics, proc.stdout

    doc = json.loads(out.read_text())
    assert doc["mode"] == "tiny" and not doc["errors"]
    assert {"nproc", "cpu", "kernel", "python"} <= set(doc["machine"])
    for row in doc["rows"]:
        assert row["ours"] is not None
        assert row["ok"] in (True, False, None)


def test_tiny_prune_e2e_times_the_whole_cli_against_its_baselines(tmp_path: Path) -> None:
    """bench/prune_e2e.py (issue 17): `ckptkeeper prune` / `restore` as processes against boto3
    and `cp -r` + sync, both data shapes; each pair reports wall, CPU and peak RSS."""
    out = tmp_path / "bench.json"
    fast = tmp_path / "fast"
    fast.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--tiny",
            "--only",
            "prune_e2e",
            "--json",
            str(out),
            "--disk-dir",
            str(tmp_path),
            "--fast-dir",
            str(fast),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a target missed, still a table
    doc = json.loads(out.read_text())
    assert not doc["errors"], doc["errors"]
    metrics = [row["metric"] for row in doc["rows"]]
    for what in ("prune hot→cold", "restore from cold", "prune hot→warm"):
        for shape in ("4 ckpts x 2 x 1 MiB", "4 ckpts x 4 files"):
            assert any(m.startswith(what) and (shape in m or what == "restore from cold") for m in metrics), (
                what,
                shape,
                metrics,
            )
    assert metrics.count("  same, CPU (user + sys, whole process)") == 6
    assert metrics.count("  same, peak RSS") == 6
    for row in doc["rows"]:
        assert row["ours"] is not None and row["ours"] > 0 and row["baseline"] > 0, row
        assert len(row["samples"]["ckptkeeper"]) == 1 == len(row["samples"]["baseline"])
    assert list(fast.iterdir()) == []  # every hot tree, home and restore removed


def test_tiny_restore_s3_times_the_whole_restore_against_boto3_and_the_old_path(tmp_path: Path) -> None:
    """bench/restore_s3.py: `ckptkeeper restore` from SeaweedFS, both data shapes, each against
    boto3, the one-GET-per-object path and the tools, alone and served by the running daemon (every
    run checks the restored byte count)."""
    out = tmp_path / "bench.json"
    fast = tmp_path / "fast"
    fast.mkdir()
    doc = _run_tiny("restore_s3", out, tmp_path, fast)
    metrics = [row["metric"] for row in doc["rows"]]
    assert [m for m in metrics if m.startswith("restore from S3")] == [
        "restore from S3 (SeaweedFS), 4 large files, 4 MiB (wall, whole process)",
        "restore from S3 (SeaweedFS), 4 small files, 5 MiB (wall, whole process)",
    ], metrics
    assert metrics.count("  same, against the one-GET-per-object restore (wall)") == 2
    for tool in ("s5cmd", "rclone", "aws s3 cp"):  # measured, or skipped with a note when not installed
        assert sum(m.startswith(f"  same, against {tool}") for m in metrics) == 2, metrics
    # the restore served by a running daemon, in the same rounds (the bench fails unless its log
    # shows every one served): whole client process, client CPU, client + daemon CPU
    served = [row for row in doc["rows"] if row["metric"].startswith("  same, served")]
    assert (
        sum(r["metric"].startswith("  same, served by the running daemon, against s5cmd") for r in served)
        == 2
    )
    if any(r["baseline"] is not None for r in served):  # s5cmd installed
        assert [r["metric"] for r in served] == 2 * [
            "  same, served by the running daemon, against s5cmd (wall, whole client process)",
            "  same, served: client CPU per GiB against s5cmd",
            "  same, served: client + daemon CPU per GiB against s5cmd",
        ]
        for r in served:
            assert r["ours"] > 0 and r["baseline"] > 0 and len(r["samples"]["served"]) == 1, r
        for client, both in zip(served[1::3], served[2::3], strict=True):
            assert both["ours"] >= client["ours"]


def test_tiny_restore_paced_restores_one_file_through_the_pacing_relay(tmp_path: Path) -> None:
    """bench/restore_paced.py: one file pruned to SeaweedFS, restored through a relay pacing each
    connection, by ckptkeeper, by ckptkeeper with every range 64 MiB, and by s5cmd when installed
    (every run checks the restored byte count)."""
    out = tmp_path / "bench.json"
    fast = tmp_path / "fast"
    fast.mkdir()
    doc = _run_tiny("restore_paced", out, tmp_path, fast)
    rows = doc["rows"]
    assert [r["metric"] for r in rows] == [
        "restore of one 8 MiB file, each connection paced at 25 MB/s (wall), against s5cmd",
        "  same, against every range 64 MiB",
    ]
    assert rows[1]["ours"] > 0 and rows[1]["baseline"] > 0
    if rows[0]["baseline"] is not None:  # s5cmd installed
        assert set(rows[0]["samples"]) == {"ckptkeeper", "fixed", "s5cmd"}


def test_tiny_restore_daemon_times_a_restore_served_by_the_daemon_against_one_alone(tmp_path: Path) -> None:
    """bench/restore_daemon.py: the same CLI restore, served by a running daemon and with
    --no-daemon (it fails unless the daemon's log shows every served restore)."""
    out = tmp_path / "bench.json"
    fast = tmp_path / "fast"
    fast.mkdir()
    doc = _run_tiny("restore_daemon", out, tmp_path, fast)
    metrics = [row["metric"] for row in doc["rows"]]
    assert metrics[0].startswith("restore of a small checkpoint") and metrics[0].endswith(
        "served by the daemon (wall, whole CLI process)"
    )
    assert metrics[1] == "  same, client CPU"
    assert all(row["ours"] is not None and row["baseline"] is not None for row in doc["rows"])


def test_tiny_compression_and_dedup_run_in_the_harness(tmp_path: Path) -> None:
    """bench/compression.py and bench/dedup.py in ``python -m bench``: cold bytes per raw byte of
    each real-framework checkpoint, client CPU against ``none``, and the whole ``ckptkeeper prune``
    to SeaweedFS with each mode against a boto3 upload of the same files, straight to the store and
    through a bandwidth-limited link."""
    out = tmp_path / "bench.json"
    fast = tmp_path / "fast"
    fast.mkdir()
    doc = _run_tiny("compression,dedup", out, tmp_path, fast)
    metrics = [row["metric"] for row in doc["rows"]]
    for ckpt in (
        "HF fp32 + Adam",
        "DCP fp32 + Adam",
        "the same, saved again",
        "HF pure bf16",
        "half frozen fp32",
        "LoRA adapter",
    ):
        assert f"compression: cold bytes per raw byte, {ckpt}" in metrics, metrics
    for side in ("auto", "zstd", "none"):
        assert any(m.startswith(f'prune to S3 (SeaweedFS), compression = "{side}"') for m in metrics), metrics
        link = f'prune to S3 (SeaweedFS) through a 25 MiB/s link, compression = "{side}"'
        assert any(m.startswith(link) for m in metrics), metrics
    assert metrics.count("  same, client CPU per raw GiB") == 3
    assert metrics.count("  same, client CPU per raw GiB (link)") == 3
    assert any(m.startswith("dedup_tensors: warm bytes per raw byte") for m in metrics), metrics
    for row in doc["rows"]:
        assert row["ours"] is not None and row["ours"] > 0 and row["baseline"] > 0, row
        if row["samples"]:  # the prune rows: 3 alternating rounds of each side
            assert len(row["samples"]["ckptkeeper"]) == 3 == len(row["samples"]["baseline"]), row
    assert list(fast.iterdir()) == []  # every hot copy removed


def test_tiny_upload_s3_measures_every_client_and_leaves_nothing(tmp_path: Path) -> None:
    """`ckptkeeper prune` to an S3 tier against boto3 and each tool installed (or a note that it
    is not), each run into a bucket of its own checked for every byte and dropped after it; the
    row names the load average; the server's data and the hot copies are gone afterwards."""
    out = tmp_path / "bench.json"
    fast, disk = tmp_path / "fast", tmp_path / "disk"
    fast.mkdir()
    disk.mkdir()
    doc = _run_tiny("upload_s3", out, disk, fast)
    [row] = doc["rows"]
    assert row["metric"].startswith("upload to S3 (SeaweedFS, ckptkeeper prune), 4 large files")
    assert row["unit"] == "cpu-s/GiB" and row["ours"] > 0 and row["baseline"] > 0
    for tool in ("s5cmd", "rclone", "aws"):
        assert tool in row["samples"] or f"{tool} is not installed" in row["note"], row
    assert all(len(v) == 1 for v in row["samples"].values()) and {"ckptkeeper", "boto3"} <= set(
        row["samples"]
    )
    assert "load average" in row["note"]
    assert list(fast.iterdir()) == [] and list(disk.iterdir()) == []
