"""Client CPU per GiB of uploading one checkpoint (4 files of 512 MiB) to S3 on a SeaweedFS server:
``ckptkeeper prune`` to an S3 tier against boto3 ``upload_file`` and the tools of
:mod:`bench._s3_tools` (s5cmd, rclone, ``aws s3 cp``; each skipped, with a note, when it is not
installed).

Every side runs once per round, the order reversed every other round; each run is a fresh process
measured from spawn to exit with ``os.wait4`` (client CPU of every thread); medians of the rounds.
``ckptkeeper`` prunes a fresh hot copy (tmpfs) with a fresh index each time, so every run uploads
a checkpoint it sees for the first time, hashed on the way (docs/uploads.md).

Each run uploads into a bucket of its own, created right before it and deleted (objects, then the
bucket) right after. SeaweedFS keeps a deleted object's bytes in its volume files until a vacuum
runs, so deleting objects alone let every run's 2 GiB pile up on the server's disk (26 GB after a
dozen runs) until the volume server could not grow a volume and answered ``InternalError`` to
UploadPart. A bucket is a SeaweedFS collection: deleting it drops its volumes, and the disk with
them, at once; each run starts on the same empty server. The bench checks the free space before it
starts and that every run stored every byte, and reports the load average around the rounds.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from bench import _s3_tools
from bench._harness import Config, GiB, MiB, Row, median, python_env
from bench.prune_e2e import Usage, measure, write_config
from bench.restore_s3 import _CREDENTIALS, MANIFEST, RUN, STEP, _make_checkpoint, _missing, seaweedfs_server
from bench.s3_transfer import _AWS_ENV

__all__ = ["run"]

LABELS = {"ckptkeeper": "ckptkeeper prune", "boto3": "boto3 upload_file", **_s3_tools.LABELS}


def _client(endpoint: str) -> object:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **_CREDENTIALS)


def _stored_bytes(s3: object, bucket: str) -> int:
    """Bytes of every object in ``bucket`` but ckptkeeper's manifest."""
    total = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):  # type: ignore[attr-defined]
        total += sum(o["Size"] for o in page.get("Contents", []) if not o["Key"].endswith(MANIFEST))
    return total


def _drop_bucket(s3: object, bucket: str) -> None:
    """Delete every object of ``bucket``, then the bucket: SeaweedFS drops its volumes (its disk)."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):  # type: ignore[attr-defined]
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})  # type: ignore[attr-defined]
    for upload in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []):  # type: ignore[attr-defined]
        s3.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])  # type: ignore[attr-defined]
    s3.delete_bucket(Bucket=bucket)  # type: ignore[attr-defined]


def _prune(home: Path, pristine: Path, endpoint: str, bucket: str, env: dict[str, str]) -> Usage:
    """``ckptkeeper prune`` of a fresh copy of ``pristine`` (and a fresh index) to ``s3://bucket/ckpt``."""
    shutil.copytree(pristine, home / "hot", copy_function=shutil.copy2)
    for p in (home / "hot").rglob("*"):  # copytree's directory mtimes are new: settle them
        if p.is_dir():
            st = (pristine / p.relative_to(home / "hot")).stat()
            os.utime(p, (st.st_atime, st.st_mtime))
    lower: dict[str, object] = {
        "name": "cold",
        "url": f"s3://{bucket}/ckpt",
        "storage_options": {"endpoint_url": endpoint, "key": "testing", "secret": "testing"},
    }
    config = write_config(home, home / "hot", lower)
    try:
        usage = measure([sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "prune"], env)
        if any((home / "hot" / RUN).glob("checkpoint-*")):
            raise RuntimeError("prune left the checkpoint in hot")
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return usage


def _sides(
    endpoint: str, src: Path, home: Path, env: dict[str, str]
) -> tuple[dict[str, Callable[[str], Usage]], list[str]]:
    """Side name -> one timed upload into the bucket given; and the tools not installed."""
    tool_env = _s3_tools.env(env)
    pristine = home / "pristine"
    boto3_job = [sys.executable, "-m", "bench._boto3_job", "upload", endpoint]
    sides: dict[str, Callable[[str], Usage]] = {
        "ckptkeeper": lambda b: _prune(home / f"home-{b}", pristine, endpoint, b, env),
        "boto3": lambda b: measure([*boto3_job, b, "ckpt", str(src)], env),
    }
    missing = []
    for tool in _s3_tools.TOOLS:
        exe = _s3_tools.find(tool)
        if exe is None:
            missing.append(tool)
            continue
        sides[tool] = functools.partial(_tool_upload, tool, exe, endpoint, src, tool_env)
    return sides, missing


def _tool_upload(tool: str, exe: str, endpoint: str, src: Path, env: dict[str, str], bucket: str) -> Usage:
    return measure(_s3_tools.upload(tool, exe, endpoint, bucket, src, "ckpt"), env)


def _rounds(
    cfg: Config, endpoint: str, sides: dict[str, Callable[[str], Usage]], total: int, reps: int
) -> dict[str, list[Usage]]:
    """``reps`` rounds, every side once per round into a bucket of its own (dropped right after),
    the order reversed every other round; each run must have stored all ``total`` bytes."""
    s3 = _client(endpoint)
    results: dict[str, list[Usage]] = {name: [] for name in sides}
    order = list(sides)
    for i in range(reps):
        for name in order if i % 2 == 0 else order[::-1]:
            bucket = f"up-{name}-{i}"
            s3.create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
            try:
                results[name].append(sides[name](bucket))
                stored = _stored_bytes(s3, bucket)
                if stored != total:
                    raise RuntimeError(f"{name} stored {stored} bytes of {total}")
            finally:
                _drop_bucket(s3, bucket)
        cfg.log(f"upload_s3: round {i + 1} of {reps}, load {_load()}")
    return results


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _check_space(data: Path, total: int) -> None:
    """The server's disk must hold one upload (twice: SeaweedFS keeps the parts until complete)."""
    free = shutil.disk_usage(data).free
    if free < 3 * total + GiB:
        raise RuntimeError(
            f"{data}: {free / GiB:.1f} GiB free, the server needs {(3 * total + GiB) / GiB:.1f} GiB "
            "(pass --disk-dir on a larger disk)"
        )


def run(cfg: Config) -> list[Row]:
    reps = cfg.pick(cfg.reps, 3, 1)
    env = {**python_env(), **_AWS_ENV}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # every Python side runs from cached bytecode
    with cfg.tempdir(cfg.fast_dir, "upload") as home, cfg.tempdir(cfg.disk_dir, "upload-weed") as data:
        total = _make_checkpoint(home / "pristine", "large", cfg.pick(512 * MiB, 32 * MiB, 1 * MiB), 0)
        _check_space(data, total)
        with seaweedfs_server(data) as endpoint:
            src = home / "pristine" / RUN / f"checkpoint-{STEP}"
            sides, missing = _sides(endpoint, src, home, env)
            before = _load()
            results = _rounds(cfg, endpoint, sides, total, reps)
            after = _load()
    return [_row(results, total, missing, f"load average {before} before the rounds, {after} after")]


def _row(results: dict[str, list[Usage]], total: int, missing: list[str], load: str) -> Row:
    gib = total / GiB
    cpu = {k: median([u.cpu / gib for u in v]) for k, v in results.items()}
    others = {k: v for k, v in cpu.items() if k != "ckptkeeper"}
    best = min(others, key=others.__getitem__)
    note = ", ".join(f"{LABELS[k]} {v:.2f}" for k, v in others.items()) + " CPU-s/GiB (medians)"
    walls = ", ".join(f"{LABELS[k]} {median([u.wall for u in v]):.1f}" for k, v in results.items())
    note += f"; wall s: {walls}; {load}" + "".join(f"; {_missing(t)}" for t in missing)
    return Row(
        metric=f"upload to S3 (SeaweedFS, ckptkeeper prune), 4 large files, {gib:.2f} GiB: client CPU per GiB",
        baseline=others[best],
        ours=cpu["ckptkeeper"],
        unit="cpu-s/GiB",
        ratio=cpu["ckptkeeper"] / others[best],
        target="<= 1.0x (lowest)",
        ok=cpu["ckptkeeper"] <= others[best],
        baseline_label=f"lowest: {LABELS[best]}",
        note=note,
        samples={k: [u.cpu / gib for u in v] for k, v in results.items()},
    )
