"""Cold-tier transfers against boto3's managed transfers, on one local moto server.

The S3 endpoint is ``python -m moto.server`` in a separate process, so its CPU is nobody's client
CPU. Each transfer runs in a fresh worker process (:mod:`bench._s3_worker`): wall time and CPU
cover the transfer only; peak RSS is the worker's whole life. The same checkpoint (four equal
tensor files on tmpfs) is uploaded by ``boto3.client.upload_file`` per file (default
``TransferConfig``: 8 MiB parts, 10 threads) and by ckptkeeper's ``S3TierStorage.copy_from``;
restored by ``download_file`` per file and by ``S3TierStorage.fetch``. Between uploads the server
is reset, so every upload starts from an empty bucket.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench._harness import Config, GiB, MiB, Row, alternate, median, python_env, run_worker

BUCKET = "bench"
RUN = "run-a"
CKPT = "checkpoint-1000"
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/ckptkeeper-bench/config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/ckptkeeper-bench/credentials",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto_server(tmp: Path) -> Iterator[str]:
    """A moto S3 server process on 127.0.0.1; objects spill to ``tmp`` (its TMPDIR)."""
    port = _free_port()
    env = {**python_env(), **_AWS_ENV, "TMPDIR": str(tmp)}
    log = open(tmp / "moto.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/moto-api/", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"moto server did not start: {(tmp / 'moto.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _reset(url: str) -> None:
    """Empty the server (objects, uploads) and recreate the bucket."""
    req = urllib.request.Request(f"{url}/moto-api/reset", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=60):
        pass
    req = urllib.request.Request(f"{url}/{BUCKET}", method="PUT", data=b"")
    with urllib.request.urlopen(req, timeout=60):
        pass


def _make_checkpoint(root: Path, n_files: int, file_bytes: int) -> tuple[list[str], str]:
    """``root/run-a/checkpoint-1000/shard-K.pt`` files of random bytes; returns (files, manifest JSON)."""
    from ckptkeeper.core.model import FileEntry, Manifest
    from ckptkeeper.util import hashing

    ckpt = root / RUN / CKPT
    ckpt.mkdir(parents=True)
    block = os.urandom(8 * MiB)
    names = []
    for i in range(n_files):
        name = f"shard-{i}.pt"
        with open(ckpt / name, "wb") as f:
            left = file_bytes
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
                block = block[1:] + block[:1]
        names.append(name)
    files = tuple(FileEntry(n, *hashing.hash_file(ckpt / n)) for n in names)
    manifest = Manifest(RUN, 1000, CKPT, "bench", True, files, {}, time.time(), "bench")
    return names, manifest.to_json()


class _Jobs:
    def __init__(self, url: str, root: Path, files: list[str], manifest: str, dest: Path) -> None:
        self.url = url
        self.root = root
        self.files = files
        self.manifest = manifest
        self.dest = dest
        self.results: dict[str, list[dict[str, Any]]] = {}

    def _run(self, label: str, job: dict[str, Any]) -> float:
        job = {"endpoint": self.url, "bucket": BUCKET, "env": _AWS_ENV, **job}
        out = run_worker("bench._s3_worker", job)
        self.results.setdefault(label, []).append(out)
        return float(out["wall"])

    def upload_boto3(self) -> float:
        _reset(self.url)
        return self._run(
            "boto3 upload",
            {
                "client": "boto3",
                "op": "upload",
                "root": str(self.root / RUN / CKPT),
                "files": self.files,
                "prefix": f"boto3/{RUN}/{CKPT}",
            },
        )

    def upload_ckptkeeper(self) -> float:
        _reset(self.url)
        return self._run(
            "ckptkeeper upload",
            {
                "client": "ckptkeeper",
                "op": "upload",
                "url": f"s3://{BUCKET}/ckpt",
                "hot_root": str(self.root),
                "manifest": self.manifest,
            },
        )

    def _clean_dest(self) -> None:
        import shutil

        shutil.rmtree(self.dest, ignore_errors=True)
        self.dest.mkdir(parents=True)

    def download_boto3(self) -> float:
        self._clean_dest()
        return self._run(
            "boto3 download",
            {
                "client": "boto3",
                "op": "download",
                "root": "",
                "files": self.files,
                "dest": str(self.dest),
                "prefix": f"ckpt/{RUN}/{CKPT}",
            },
        )

    def download_ckptkeeper(self) -> float:
        self._clean_dest()
        return self._run(
            "ckptkeeper download",
            {
                "client": "ckptkeeper",
                "op": "download",
                "url": f"s3://{BUCKET}/ckpt",
                "dest": str(self.dest),
                "manifest": self.manifest,
            },
        )


def run(cfg: Config) -> list[Row]:
    n_files = 4
    file_bytes = cfg.pick(512 * MiB, 256 * MiB, 8 * MiB)
    reps = cfg.pick(cfg.reps, 3, 1)
    total = n_files * file_bytes
    rows: list[Row] = []
    with (
        cfg.tempdir(cfg.fast_dir, "s3-data") as data,
        cfg.tempdir(cfg.disk_dir, "s3-server") as server_tmp,
        moto_server(server_tmp) as url,
    ):
        files, manifest = _make_checkpoint(data / "hot", n_files, file_bytes)
        jobs = _Jobs(url, data / "hot", files, manifest, data / "restore")
        base, ours = alternate(jobs.upload_boto3, jobs.upload_ckptkeeper, reps, log=cfg.log)
        b_res, o_res = jobs.results["boto3 upload"], jobs.results["ckptkeeper upload"]
        size = f"{n_files} x {file_bytes // MiB} MiB"
        ratio = median(base) / median(ours)
        rows.append(
            Row(
                metric=f"upload to cold, {size} (wall)",
                baseline=median(base),
                ours=median(ours),
                unit="s",
                ratio=ratio,
                target=">= 1.0x",
                ok=ratio >= 1.0,
                baseline_label="boto3 upload_file",
                note=f"ckptkeeper {total / MiB / median(ours):.0f} MiB/s, boto3 {total / MiB / median(base):.0f} MiB/s "
                "through the same local moto server",
                samples={"baseline": base, "ckptkeeper": ours},
            )
        )
        gib = total / GiB
        b_cpu = [r["cpu"] / gib for r in b_res]
        o_cpu = [r["cpu"] / gib for r in o_res]
        cpu_ratio = median(o_cpu) / median(b_cpu)
        rows.append(
            Row(
                metric="upload to cold, client CPU per GiB",
                baseline=median(b_cpu),
                ours=median(o_cpu),
                unit="cpu-s/GiB",
                ratio=cpu_ratio,
                target="<= 0.8x",
                ok=cpu_ratio <= 0.8,
                baseline_label="boto3",
                samples={"baseline": b_cpu, "ckptkeeper": o_cpu},
            )
        )
        b_rss = max(r["maxrss"] for r in b_res) / MiB
        o_rss = max(r["maxrss"] for r in o_res) / MiB
        b_setup = max(r["setup_rss"] for r in b_res) / MiB
        o_setup = max(r["setup_rss"] for r in o_res) / MiB
        rows.append(
            Row(
                metric=f"upload to cold, peak RSS ({gib:.1f} GiB checkpoint)",
                baseline=b_rss,
                ours=o_rss,
                unit="MiB",
                ratio=o_rss / b_rss,
                target="<= 256 MiB and <= boto3",
                ok=o_rss <= 256 and o_rss <= b_rss,
                baseline_label="boto3",
                note=(
                    f"whole worker process; before the first byte (imports + client) {o_setup:.0f} MiB vs boto3 "
                    f"{b_setup:.0f} MiB (s3fs/aiobotocore/aiohttp stack), the transfer itself adds "
                    f"{o_rss - o_setup:.0f} MiB vs boto3 {b_rss - b_setup:.0f} MiB"
                ),
                samples={
                    "baseline": [r["maxrss"] / MiB for r in b_res],
                    "ckptkeeper": [r["maxrss"] / MiB for r in o_res],
                },
            )
        )

        _reset(url)
        jobs.upload_ckptkeeper()  # the copy both restores read (boto3 by key)
        base_d, ours_d = alternate(jobs.download_boto3, jobs.download_ckptkeeper, reps, log=cfg.log)
        ratio_d = median(base_d) / median(ours_d)
        od_res = jobs.results["ckptkeeper download"]
        bd_res = jobs.results["boto3 download"]
        rows.append(
            Row(
                metric=f"restore from cold, {size} (wall)",
                baseline=median(base_d),
                ours=median(ours_d),
                unit="s",
                ratio=ratio_d,
                target=">= 1.0x",
                ok=ratio_d >= 1.0,
                baseline_label="boto3 download_file",
                note=(
                    f"ckptkeeper verifies every byte against the manifest; client CPU/GiB "
                    f"{median([r['cpu'] / gib for r in od_res]):.2f} vs boto3 {median([r['cpu'] / gib for r in bd_res]):.2f}"
                ),
                samples={"baseline": base_d, "ckptkeeper": ours_d},
            )
        )
    return rows
