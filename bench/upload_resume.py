"""Finishing an upload to S3 that ``kill -9`` cut at half way: resumed from its stored parts vs
started again.

Each repetition uploads one file (``S3TierStorage.copy_from``) in a worker process that SIGKILLs
itself once half the file's bytes went through the copy loop, then finishes the copy in a fresh
worker, as the next ``prune`` would: the executor's recovery (``discard_staging`` of the
interrupted copy's marker), then the copy again. "restart" aborts the interrupted upload first
(what happened before uploads were resumable); "resume" keeps it, so the copy lists its parts and
sends only the missing ones. Both read and hash the whole file again. The S3 endpoint is a moto
server process (:func:`bench.s3_transfer.moto_server`).

Run as a module (``python -m bench.upload_resume``), this file is that worker: a JSON job on stdin,
one JSON line out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from bench._harness import Config, MiB, Row, alternate, median, python_env, run_worker
from bench.s3_transfer import _AWS_ENV, BUCKET, _make_checkpoint, _reset, moto_server

RUN, CKPT = "run-a", "checkpoint-1000"


def _tiers(job: dict[str, Any]) -> tuple[Any, Any, Any]:
    from ckptkeeper.core.model import Manifest, TierPolicy, TierSpec
    from ckptkeeper.storage import TierStorage

    manifest = Manifest.from_json(job["manifest"])
    cold = TierStorage(
        TierSpec(
            "cold", f"s3://{BUCKET}/ckpt", TierPolicy(), storage_options={"endpoint_url": job["endpoint"]}
        )
    )
    cold.part_size = job["part_size"]  # type: ignore[attr-defined]
    hot = TierStorage(TierSpec("hot", job["hot_root"], TierPolicy()), hot=True)
    return manifest, cold, hot


def _interrupt(job: dict[str, Any]) -> None:
    """Copy, and SIGKILL this process once half the bytes went through the copy loop."""
    manifest, cold, hot = _tiers(job)
    half, done = manifest.total_bytes // 2, [0]

    def progress(n: int) -> None:
        done[0] += n
        if done[0] >= half:
            os.kill(os.getpid(), signal.SIGKILL)

    cold.copy_from(hot, manifest, progress=progress)
    raise SystemExit("the copy finished before it was killed")


def _finish(job: dict[str, Any]) -> dict[str, Any]:
    """Recover the interrupted copy as the executor does, then copy again; count the bytes sent."""
    from ckptkeeper.storage.s3_upload import _S3FileWriter

    manifest, cold, hot = _tiers(job)
    sent = [0]
    send = _S3FileWriter._send

    async def counting_send(self: _S3FileWriter, method: str, body: Any, crc: str, **kw: Any) -> Any:
        sent[0] += len(body.getbuffer())
        return await send(self, method, body, crc, **kw)

    _S3FileWriter._send = counting_send  # type: ignore[method-assign]
    cold.fs.ls(BUCKET)  # session and connection outside the timing
    t0 = time.perf_counter()
    if job["mode"] == "restart":
        cold._abort_uploads_under(cold._key(f"{RUN}/{CKPT}"))
    for artifact in cold.list_staging():
        cold.discard_staging(artifact)
    cold.copy_from(hot, manifest)
    return {"wall": time.perf_counter() - t0, "sent": sent[0]}


def run(cfg: Config) -> list[Row]:
    file_bytes = cfg.pick(1024 * MiB, 256 * MiB, 24 * MiB)
    part_size = cfg.pick(16 * MiB, 16 * MiB, 5 * MiB)
    reps = cfg.pick(cfg.reps, 3, 1)
    sent: dict[str, list[float]] = {"restart": [], "resume": []}
    with (
        cfg.tempdir(cfg.fast_dir, "resume-data") as data,
        cfg.tempdir(cfg.disk_dir, "resume-server") as server_tmp,
        moto_server(server_tmp) as url,
    ):
        _, manifest = _make_checkpoint(data / "hot", 1, file_bytes)
        job = {
            "endpoint": url,
            "hot_root": str(data / "hot"),
            "manifest": manifest,
            "part_size": part_size,
            "env": _AWS_ENV,
        }
        env = {**python_env(), **_AWS_ENV}

        def finish(mode: str) -> float:
            _reset(url)
            killed = subprocess.run(
                [sys.executable, "-m", "bench.upload_resume"],
                input=json.dumps({**job, "op": "interrupt"}),
                capture_output=True,
                text=True,
                env=env,
                timeout=1800,
                check=False,
            )
            if killed.returncode != -signal.SIGKILL:
                raise RuntimeError(f"the interrupted upload was not killed: {killed.stderr[-2000:]}")
            out = run_worker("bench.upload_resume", {**job, "op": "finish", "mode": mode})
            sent[mode].append(out["sent"] / MiB)
            return float(out["wall"])

        restart, resume = alternate(
            lambda: finish("restart"),
            lambda: finish("resume"),
            reps,
            log=cfg.log,
            names=("restart", "resume"),
        )
    size = f"{file_bytes // MiB} MiB"
    ratio = median(restart) / median(resume)
    # half the file went through the copy loop; up to max_inflight + 1 parts of it were not stored
    bound = 0.5 + 4 * part_size / file_bytes
    sent_ratio = median(sent["resume"]) / median(sent["restart"])
    return [
        Row(
            metric=f"finish a {size} upload killed at 50 % (wall)",
            baseline=median(restart),
            ours=median(resume),
            unit="s",
            ratio=ratio,
            target=">= 1.2x",
            ok=ratio >= 1.2,
            baseline_label="upload again",
            note="both re-read and re-hash the whole file; resume lists the upload's parts and sends the rest",
            samples={"baseline": restart, "ckptkeeper": resume},
        ),
        Row(
            metric=f"finish a {size} upload killed at 50 % (bytes sent)",
            baseline=median(sent["restart"]),
            ours=median(sent["resume"]),
            unit="MiB",
            ratio=sent_ratio,
            target=f"<= {bound:.2f}x",
            ok=sent_ratio <= bound,
            baseline_label="upload again",
            note=f"{part_size // MiB} MiB parts; the parts in flight at the kill are sent again",
            samples={"baseline": sent["restart"], "ckptkeeper": sent["resume"]},
        ),
    ]


def main() -> None:
    job = json.loads(sys.stdin.read())
    for name, value in job.get("env", {}).items():
        os.environ[name] = value
    if job["op"] == "interrupt":
        _interrupt(job)
    else:
        print(json.dumps(_finish(job)))


if __name__ == "__main__":
    main()
