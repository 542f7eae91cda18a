"""Finishing an upload to S3 that ``kill -9`` cut at half way: resumed from its stored parts vs
started again.

Each repetition uploads one file (``S3TierStorage.copy_from``) in a worker process that SIGKILLs
itself once half the file's bytes went through the copy loop, then finishes the copy in a fresh
worker, as the next ``prune`` would: the executor's recovery (``discard_staging`` of the
interrupted copy's marker), then the copy again. "restart" aborts the interrupted upload first
(what happened before uploads were resumable); "resume" keeps it, so the copy lists its parts and
sends only the missing ones. Both read and hash the whole file again. The S3 endpoint is a moto
server process (:func:`bench.s3_transfer.moto_server`).

The same for a checkpoint of several large files killed at half way: the files the killed copy
had finished are kept (its staging marker records them), not sent again.

And what a whole ``ckptkeeper prune`` moving a new checkpoint from tmpfs to a SeaweedFS S3 tier
reads per byte moved (``rchar`` of the process), with its client CPU and peak RSS: hashed from the
bytes the upload sends, against hashed by the catalog first (what it did before, and still does
for a checkpoint it has hashed already: ``hot_once.applies`` forced off).

Run as a module (``python -m bench.upload_resume``), this file is that worker: a JSON job on stdin,
one JSON line out.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._harness import Config, MiB, Row, alternate, median, python_env, run_worker
from bench.s3_transfer import _AWS_ENV, BUCKET, _make_checkpoint, _reset, moto_server


def _delete_prefix(endpoint: str, prefix: str) -> None:
    """Remove what one prune uploaded (the server's disk holds one copy at a time)."""
    from bench.restore_s3 import _delete_prefix as delete

    delete(endpoint, prefix)


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
    half, done = int(manifest.total_bytes * job.get("kill_at", 0.5)), [0]

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
        key = cold._key(f"{RUN}/{CKPT}")
        cold._abort_uploads_under(key)
        cold._delete_keys([k for k, _, _ in cold._target_objects(key)])
    for artifact in cold.list_staging():
        cold.discard_staging(artifact)
    cold.copy_from(hot, manifest)
    return {"wall": time.perf_counter() - t0, "sent": sent[0]}


def run(cfg: Config) -> list[Row]:
    rows = []
    file_bytes = cfg.pick(1024 * MiB, 256 * MiB, 24 * MiB)
    part_size = cfg.pick(16 * MiB, 16 * MiB, 5 * MiB)
    rows += _resume_rows(cfg, 1, file_bytes, part_size, 0.5)
    # 4 files: killed 5/8 of the way, in the third file, the first two finished
    rows += _resume_rows(cfg, 4, file_bytes // 4, part_size, 0.625)
    rows += read_once_rows(cfg)
    return rows


def _resume_rows(cfg: Config, n_files: int, file_bytes: int, part_size: int, kill_at: float) -> list[Row]:
    """Finish an upload of ``n_files`` files killed ``kill_at`` of the way: resumed vs started again."""
    reps = cfg.pick(cfg.reps, 3, 1)
    sent: dict[str, list[float]] = {"restart": [], "resume": []}
    with (
        cfg.tempdir(cfg.fast_dir, "resume-data") as data,
        cfg.tempdir(cfg.disk_dir, "resume-server") as server_tmp,
        moto_server(server_tmp) as url,
    ):
        _, manifest = _make_checkpoint(data / "hot", n_files, file_bytes)
        job = {
            "endpoint": url,
            "hot_root": str(data / "hot"),
            "manifest": manifest,
            "part_size": part_size,
            "kill_at": kill_at,
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
    total = n_files * file_bytes
    size = f"{file_bytes // MiB} MiB" if n_files == 1 else f"{n_files} x {file_bytes // MiB} MiB"
    at = f"{kill_at * 100:.0f} %"
    ratio = median(restart) / median(resume)
    # what the copy loop had not reached, plus up to max_inflight + 1 parts of it not stored
    bound = (1 - kill_at) + 4 * part_size / total
    sent_ratio = median(sent["resume"]) / median(sent["restart"])
    what = "the files the killed copy finished are kept; " if n_files > 1 else ""
    return [
        Row(
            metric=f"finish a {size} upload killed at {at} (wall)",
            baseline=median(restart),
            ours=median(resume),
            unit="s",
            ratio=ratio,
            target=">= 1.2x",
            ok=ratio >= 1.2,
            baseline_label="upload again",
            note="both re-read and re-hash every file; resume lists the upload's parts and sends the rest",
            samples={"baseline": restart, "ckptkeeper": resume},
        ),
        Row(
            metric=f"finish a {size} upload killed at {at} (bytes sent)",
            baseline=median(sent["restart"]),
            ours=median(sent["resume"]),
            unit="MiB",
            ratio=sent_ratio,
            target=f"<= {bound:.2f}x",
            ok=sent_ratio <= bound,
            baseline_label="upload again",
            note=f"{what}{part_size // MiB} MiB parts; the parts in flight at the kill are sent again",
            samples={"baseline": sent["restart"], "ckptkeeper": sent["resume"]},
        ),
    ]


_HASH_FIRST = """
import sys
from ckptkeeper.actions.pruning import hot_once
hot_once.applies = lambda state: False  # the catalog hashes every new checkpoint first
from ckptkeeper.cli import main
sys.argv = ["ckptkeeper", *sys.argv[1:]]
sys.exit(main())
"""


def _prune_measured(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run ``argv`` to its end: ``rchar`` (read from ``/proc`` while it is a zombie), client CPU
    seconds and peak RSS (``wait4``)."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    with open(f"/proc/{proc.pid}/io") as f:
        rchar = int(next(line.split()[1] for line in f if line.startswith("rchar:")))
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"prune exited {proc.returncode}: {err[-2000:]}")
    return {"rchar": rchar, "cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss / 1024}


class _S3Mover:
    """A fresh node (index scanned, the checkpoint and a small newest one in hot) per ``prune``
    to the SeaweedFS tier, each under its own prefix, removed after it."""

    def __init__(self, home: Path, template: Path, newest: Path, endpoint: str, env: dict[str, str]) -> None:
        self.home, self.template, self.newest, self.endpoint, self.env = home, template, newest, endpoint, env
        self.count = 0
        self.got: dict[str, list[dict[str, float]]] = {"first": [], "once": []}

    def _config(self, hot: Path) -> Path:
        config = self.home / "ckptkeeper.toml"
        options = {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}
        config.write_text(
            f"index = {json.dumps(str(self.home / 'index.db'))}\n"
            '[daemon]\nmetrics_addr = ""\ntrust_mtimes = true\n'
            f'[[tiers]]\nname = "hot"\nurl = {json.dumps(str(hot))}\nkeep_last = 1\n'
            f'[[tiers]]\nname = "cold"\nurl = "s3://bench/readonce-{self.count}"\nkeep_last = 10\n'
            "storage_options = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items()) + " }\n"
        )
        return config

    def prune(self, mode: str, idle: list[float] | None = None) -> float:
        """One measured ``prune`` (``mode``: ``once``, or ``first``: the catalog hashes first);
        ``idle`` gets what a second one, with nothing to move, reads."""
        self.count += 1
        shutil.rmtree(self.home, ignore_errors=True)
        hot = self.home / "hot"
        (hot / RUN).mkdir(parents=True)
        cli = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(self._config(hot))]
        subprocess.run([*cli, "scan"], env=self.env, check=True, capture_output=True)
        subprocess.run(["cp", "-a", str(self.template), str(hot / RUN / CKPT)], check=True)
        subprocess.run(["cp", "-a", str(self.newest), str(hot / RUN / self.newest.name)], check=True)
        argv = [*cli, "prune", "--json"]
        if mode == "first":
            argv = [sys.executable, "-c", _HASH_FIRST, *cli[3:], "prune", "--json"]
        t0 = time.perf_counter()
        out = _prune_measured(argv, self.env)
        wall = time.perf_counter() - t0
        if (hot / RUN / CKPT).exists():
            raise RuntimeError("prune did not move the checkpoint to S3")
        self.got[mode].append(out)
        if idle is not None:
            idle.append(_prune_measured([*cli, "prune", "--json"], self.env)["rchar"])
        _delete_prefix(self.endpoint, f"readonce-{self.count}")
        return wall


def read_once_rows(cfg: Config) -> list[Row]:
    """``ckptkeeper prune`` moving a new checkpoint tmpfs → SeaweedFS: bytes read from hot per byte
    moved, client CPU per GiB and peak RSS, hashed on the way vs hashed by the catalog first."""
    from bench.restore_s3 import seaweedfs_server
    from bench.tier_move import _small_newest, make_template

    size = cfg.pick(1536 * MiB, 512 * MiB, 24 * MiB)
    reps = cfg.pick(cfg.reps, 3, 1)
    with (
        cfg.tempdir(cfg.fast_dir, "readonce-hot") as fast,
        cfg.tempdir(cfg.disk_dir, "readonce-weed") as weed_dir,
        seaweedfs_server(weed_dir) as endpoint,
    ):
        template = make_template(fast / "template", size)
        newest = _small_newest(fast / "newest")
        moved = sum(p.stat().st_size for p in template.rglob("*") if p.is_file())
        env = {**python_env(), **_AWS_ENV}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        mover = _S3Mover(fast / "home", template, newest, endpoint, env)
        prune, got = mover.prune, mover.got
        idle: list[float] = []
        prune("once", idle)  # warm-up, untimed: bytecode, SeaweedFS's first volume
        got["once"].clear()
        first, once = alternate(
            lambda: prune("first"), lambda: prune("once"), reps, log=cfg.log, names=("hash first", "once")
        )
    gib = moved / 2**30
    rows = []
    for label, key, scale, unit in (
        ("bytes read per byte moved (rchar of the process)", "rchar", 1 / moved, "x"),
        ("client CPU-s per GiB", "cpu", 1 / gib, "CPU-s/GiB"),
        ("peak RSS", "rss", 1.0, "MiB"),
    ):
        base = [r[key] * scale for r in got["first"]]
        ours = [r[key] * scale for r in got["once"]]
        ratio = median(ours) / median(base)
        net = median(ours) - idle[0] / moved
        target, ok = {"rchar": ("<= 1.05x net", net <= 1.05)}.get(key, ("info", True))
        rows.append(
            Row(
                metric=f"prune to S3 (SeaweedFS), {size // MiB} MiB new checkpoint from tmpfs: {label}",
                baseline=median(base),
                ours=median(ours),
                unit=unit,
                ratio=ratio,
                target=target,
                ok=ok,
                baseline_label="hashed by the catalog first",
                note=f"{net:.3f}x net of the {idle[0] / MiB:.1f} MiB a pass with nothing to move reads "
                f"({median(base) - idle[0] / moved:.3f}x hashed first); wall {median(once):.1f} s vs "
                f"{median(first):.1f} s; medians of {reps}"
                if key == "rchar"
                else "16 MiB parts, 3 in flight, sent from the buffers the copy read them into",
                samples={"baseline": base, "ckptkeeper": ours},
            )
        )
    return rows


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
