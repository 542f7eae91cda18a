"""``ckptkeeper restore`` from S3, timed whole, on a SeaweedFS server (Go: not itself the bound,
as a Python moto server would be), against the S3 clients a user would otherwise reach for.

One checkpoint per shape is pruned from a hot tmpfs tier to ``s3://bench/<shape>`` with the real
CLI, then restored again and again, round-robin (every side once per round, the order reversed
every other round), each one a fresh process measured from spawn to exit with ``os.wait4`` (wall,
client CPU of every thread, peak RSS); medians of the rounds:

* **ckptkeeper**: ``ckptkeeper restore RUN --step N --to DIR`` (parallel ranged GETs written in
  place, hashed as they arrive, verified against the manifest, fsync-ed, renamed into place);
* **ckptkeeper, served**: the same command while a ``ckptkeeper daemon`` runs that very config
  (started once per shape, before the rounds): the CLI is a thin client of the daemon's restore
  socket and the daemon, warm, does the work. The daemon's own CPU during each one is read from
  ``/proc/<pid>/stat``, so the rows give the client's CPU and the client's plus the daemon's. The
  other ``ckptkeeper`` sides pass ``--no-daemon``; the daemon's log must show exactly one served
  restore per round, or the bench fails;
* **ckptkeeper, one GET per object**: the same command through :mod:`bench._restore_stream`, which
  puts back the restore path before ranged GETs (4 objects at a time, each one streamed GET);
* **boto3**: a ``python`` process that imports boto3 and ``download_file``s the same objects
  (default ``TransferConfig``: 8 MiB ranged GETs on 10 threads), with no verification;
* **s5cmd**, **rclone**, **aws s3 cp** (:mod:`bench._s3_tools`; each skipped, with a note, when it
  is not installed): ``cp``/``copy`` of the checkpoint's prefix with the tool's defaults, no
  verification beyond the tool's own.

Then the same restore in one warm process (:mod:`bench._fetch_warm`: what a restore served by a
long-running process costs, start-up excluded). Uploads are :mod:`bench.upload_s3`.

Shapes: a few large files (4 x 128 MiB) and many small ones (200 files of 64 KiB-4 MiB).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bench import _s3_tools
from bench._harness import Config, GiB, MiB, Row, median, python_env
from bench._served import Daemon, running_daemon, served_restores
from bench.prune_e2e import Usage, _random_bytes, _safetensors, measure, write_config
from bench.s3_transfer import _AWS_ENV

BUCKET = "bench"
RUN = "run-a"
STEP = 400
MANIFEST = ".ckptkeeper-manifest.json"
_CREDENTIALS = {
    "aws_access_key_id": _AWS_ENV["AWS_ACCESS_KEY_ID"],
    "aws_secret_access_key": _AWS_ENV["AWS_SECRET_ACCESS_KEY"],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def seaweedfs_server(data: Path) -> Iterator[str]:
    """``weed server`` (master, volume, filer, S3 gateway) on 127.0.0.1 with a ``bench`` bucket."""
    weed = str(Path(sys.executable).parent / "weed")
    if not Path(weed).exists():
        weed = shutil.which("weed") or weed
    ports = {f"{n}.port{g}": _free_port() for n in ("master", "volume", "filer", "s3") for g in ("", ".grpc")}
    args = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-volume.max=0",
        "-master.volumeSizeLimitMB=1024", "-s3", "-s3.port.iceberg=0", "-s3.port.lance=0",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]  # fmt: skip
    log = (data / "weed.log").open("wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    try:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **_CREDENTIALS)
        deadline = time.monotonic() + 90
        while True:
            try:
                client.create_bucket(Bucket=BUCKET)
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"weed server did not come up: see {data / 'weed.log'}") from None
                time.sleep(0.5)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _make_checkpoint(hot: Path, shape: str, large: int, files: int) -> int:
    """``hot/run-a/checkpoint-400`` (HF layout), settled an hour ago; returns its bytes."""
    rng = random.Random(31)
    ckpt = hot / RUN / f"checkpoint-{STEP}"
    ckpt.mkdir(parents=True)
    if shape == "large":
        _safetensors(ckpt / "model.safetensors", large, rng)
        for k in range(3):
            with open(ckpt / f"optimizer-{k}.pt", "wb") as f:
                _random_bytes(f, large, rng)
    else:
        _safetensors(ckpt / "model.safetensors", 4 * MiB, rng)
        for k in range(files - 1):
            sub = ckpt / f"shard-{k % 8}"
            sub.mkdir(exist_ok=True)
            with open(sub / f"part-{k:04d}.bin", "wb") as f:
                _random_bytes(f, int(2 ** rng.uniform(16, 22)), rng)
    (ckpt / "trainer_state.json").write_text(f'{{"global_step": {STEP}, "log_history": []}}')
    when = time.time() - 3600
    total = 0
    for p in [*ckpt.rglob("*"), ckpt]:
        total += p.stat().st_size if p.is_file() else 0
        os.utime(p, (when, when))
    return total


def _shape(cfg: Config, endpoint: str, shape: str, label: str, reps: int) -> list[Row]:
    env = {**python_env(), **_AWS_ENV}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # both sides run from cached bytecode
    tool_env = _s3_tools.env(env)
    with cfg.tempdir(cfg.fast_dir, f"restore-{shape}") as home:
        total = _make_checkpoint(
            home / "hot", shape, cfg.pick(128 * MiB, 32 * MiB, 1 * MiB), cfg.pick(200, 60, 4)
        )
        lower: dict[str, object] = {
            "name": "cold",
            "url": f"s3://{BUCKET}/{shape}",
            "storage_options": {"endpoint_url": endpoint, "key": "testing", "secret": "testing"},
        }
        config = write_config(home, home / "hot", lower)
        prune = measure([sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "prune"], env)
        cfg.log(f"restore_s3 {shape}: pruned {total / MiB:.0f} MiB to S3 in {prune.wall:.1f} s")
        dest = home / "restore"
        restore = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "restore", RUN]
        restore += ["--step", str(STEP), "--to", str(dest)]
        prefix = f"{shape}/{RUN}/checkpoint-{STEP}"
        boto3_job = [sys.executable, "-m", "bench._boto3_job", "download", endpoint, BUCKET]
        boto3_job += [prefix, str(dest), MANIFEST]
        sides = {
            "boto3": (boto3_job, env),
            "ckptkeeper": ([*restore, "--no-daemon"], env),
            "before": ([sys.executable, "-m", "bench._restore_stream", *restore[3:], "--no-daemon"], env),
            "served": (restore, env),
        }
        missing = []
        for tool in _s3_tools.TOOLS:
            exe = _s3_tools.find(tool)
            if exe is None:
                missing.append(tool)
                continue
            target = dest / f"checkpoint-{STEP}"
            sides[tool] = (_s3_tools.download(tool, exe, endpoint, BUCKET, prefix, target), tool_env)
        with running_daemon(config, env, home / "daemon.log") as daemon:
            results, daemon_cpu = _rounds(cfg, shape, sides, dest, total, reps, daemon)
        served = served_restores(home / "daemon.log", dest)
        if served != reps:
            log = (home / "daemon.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the daemon served {served} of the {reps} 'served' restores:\n{log}")
        warm = _warm(config, dest, reps, env)
    what = f"restore from S3 (SeaweedFS), {label}, {total / MiB:.0f} MiB"
    rows = _rows(what, results, total / GiB) + _tool_rows(results, total / GiB, missing)
    return rows + _warm_rows(warm, results, total / GiB) + _served_rows(results, daemon_cpu, total / GiB)


def _rounds(
    cfg: Config,
    shape: str,
    sides: dict[str, tuple[list[str], dict[str, str]]],
    dest: Path,
    total: int,
    reps: int,
    daemon: Daemon,
) -> tuple[dict[str, list[Usage]], list[float]]:
    """``reps`` rounds, every side once per round, the order reversed every other round; for the
    restores the daemon serves, its own CPU-seconds during each (``/proc/<pid>/stat``)."""
    results: dict[str, list[Usage]] = {name: [] for name in sides}
    daemon_cpu: list[float] = []
    order = list(sides)
    for i in range(reps):
        for name in order if i % 2 == 0 else order[::-1]:
            shutil.rmtree(dest, ignore_errors=True)
            argv, side_env = sides[name]
            before = daemon.cpu()
            results[name].append(measure(argv, side_env))
            if name == "served":
                daemon_cpu.append(daemon.cpu() - before)
            got = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
            if name != "boto3" and got != total:
                raise RuntimeError(f"{name} restored {got} bytes of {total}")
        cfg.log(f"restore_s3 {shape}: round {i + 1} of {reps}")
    return results, daemon_cpu


def _warm(config: Path, dest: Path, reps: int, env: dict[str, str]) -> dict[str, list[float]]:
    """``reps`` restores in one warm process (:mod:`bench._fetch_warm`): wall and CPU of each."""
    argv = [sys.executable, "-m", "bench._fetch_warm", str(config), RUN, str(STEP), str(dest), str(reps)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"bench._fetch_warm failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    shutil.rmtree(dest, ignore_errors=True)
    doc: dict[str, list[float]] = json.loads(proc.stdout.splitlines()[-1])
    return doc


def _warm_rows(warm: dict[str, list[float]], results: dict[str, list[Usage]], gib: float) -> list[Row]:
    """The restore in a process already warm (what a restore served by the daemon costs), against
    s5cmd's whole process: the start-up a CLI process pays is all that separates the two."""
    if "s5cmd" not in results:
        return []
    wall, cpu = median(warm["wall"]), median([c / gib for c in warm["cpu"]])
    s5_wall = median([u.wall for u in results["s5cmd"]])
    s5_cpu = median([u.cpu / gib for u in results["s5cmd"]])
    return [
        Row(
            metric="  same, in a warm process (imports, config, client done), against s5cmd (wall)",
            baseline=s5_wall,
            ours=wall,
            unit="s",
            ratio=s5_wall / wall,
            target="info",
            ok=None,
            baseline_label="s5cmd",
            samples={"warm": warm["wall"]},
        ),
        Row(
            metric="  same, in a warm process, client CPU per GiB against s5cmd",
            baseline=s5_cpu,
            ours=cpu,
            unit="cpu-s/GiB",
            ratio=cpu / s5_cpu,
            target="info",
            ok=None,
            baseline_label="s5cmd",
            samples={"warm": [c / gib for c in warm["cpu"]]},
        ),
    ]


def _served_rows(results: dict[str, list[Usage]], daemon_cpu: list[float], gib: float) -> list[Row]:
    """The restore served by the running daemon (the CLI a thin client of its socket), timed in the
    same rounds against s5cmd: the client's whole process, then what the node pays in all (client
    and daemon CPU)."""
    served = results["served"]
    wall = median([u.wall for u in served])
    client = [u.cpu / gib for u in served]
    both = [(u.cpu + d) / gib for u, d in zip(served, daemon_cpu, strict=True)]
    if "s5cmd" not in results:
        note = _missing("s5cmd")
        return [
            Row("  same, served by the running daemon, against s5cmd", None, wall, "s", "-", None, note=note)
        ]
    s5_wall = median([u.wall for u in results["s5cmd"]])
    s5_cpu = median([u.cpu / gib for u in results["s5cmd"]])
    daemon_note = f"the daemon's own CPU: {median([d / gib for d in daemon_cpu]):.2f} CPU-s/GiB"
    s5_walls = [u.wall for u in results["s5cmd"]]
    paired = sorted(s5 / u.wall for s5, u in zip(s5_walls, served, strict=True))  # same round each
    spread = (
        f"every round: ours {min(u.wall for u in served):.2f}-{max(u.wall for u in served):.2f} s, "
        f"s5cmd {min(s5_walls):.2f}-{max(s5_walls):.2f} s; s5cmd/ours per round "
        f"{paired[0]:.2f}x-{paired[-1]:.2f}x (median {median(paired):.2f}x)"
    )
    return [
        Row(
            metric="  same, served by the running daemon, against s5cmd (wall, whole client process)",
            baseline=s5_wall,
            ours=wall,
            unit="s",
            ratio=s5_wall / wall,
            target=">= 1.0x",
            ok=s5_wall / wall >= 1.0,
            baseline_label="s5cmd",
            note="`ckptkeeper restore` with the daemon's config; every one served (the daemon's log); "
            + spread,
            samples={"served": [u.wall for u in served], "s5cmd": [u.wall for u in results["s5cmd"]]},
        ),
        Row(
            metric="  same, served: client CPU per GiB against s5cmd",
            baseline=s5_cpu,
            ours=median(client),
            unit="cpu-s/GiB",
            ratio=median(client) / s5_cpu,
            target="<= 1.3x",
            ok=median(client) <= 1.3 * s5_cpu,
            baseline_label="s5cmd",
            samples={"served": client},
        ),
        Row(
            metric="  same, served: client + daemon CPU per GiB against s5cmd",
            baseline=s5_cpu,
            ours=median(both),
            unit="cpu-s/GiB",
            ratio=median(both) / s5_cpu,
            target="<= 1.3x",
            ok=median(both) <= 1.3 * s5_cpu,
            baseline_label="s5cmd",
            note=daemon_note,
            samples={"served": both, "daemon": [d / gib for d in daemon_cpu]},
        ),
    ]


def _rows(what: str, results: dict[str, list[Usage]], gib: float) -> list[Row]:
    wall = {k: median([u.wall for u in v]) for k, v in results.items()}
    cpu = {k: median([u.cpu / gib for u in v]) for k, v in results.items()}
    note = (
        f"one GET per object (before): {wall['before']:.2f} s, {cpu['before']:.2f} CPU-s/GiB; "
        "whole processes, imports and config included"
    )
    return [
        Row(
            metric=f"{what} (wall, whole process)",
            baseline=wall["boto3"],
            ours=wall["ckptkeeper"],
            unit="s",
            ratio=wall["boto3"] / wall["ckptkeeper"],
            target=">= 1.0x",
            ok=wall["boto3"] / wall["ckptkeeper"] >= 1.0,
            baseline_label="boto3 download_file",
            note=note,
            samples={k: [u.wall for u in v] for k, v in results.items()},
        ),
        Row(
            metric="  same, client CPU per GiB",
            baseline=cpu["boto3"],
            ours=cpu["ckptkeeper"],
            unit="cpu-s/GiB",
            ratio=cpu["ckptkeeper"] / cpu["boto3"],
            target="<= 1.0x",
            ok=cpu["ckptkeeper"] <= cpu["boto3"],
            baseline_label="boto3",
            samples={k: [u.cpu / gib for u in v] for k, v in results.items()},
        ),
        Row(
            metric="  same, against the one-GET-per-object restore (wall)",
            baseline=wall["before"],
            ours=wall["ckptkeeper"],
            unit="s",
            ratio=wall["before"] / wall["ckptkeeper"],
            target="info",
            ok=None,
            baseline_label="ckptkeeper before",
        ),
    ]


def _tool_rows(results: dict[str, list[Usage]], gib: float, missing: list[str]) -> list[Row]:
    """The same restore against s5cmd (the targets) and rclone / the AWS CLI (for information)."""
    ours_wall = median([u.wall for u in results["ckptkeeper"]])
    ours_cpu = median([u.cpu / gib for u in results["ckptkeeper"]])
    rows = []
    for tool in _s3_tools.TOOLS:
        name = _s3_tools.LABELS[tool]
        if tool in missing:
            rows.append(Row(f"  same, against {name}", None, ours_wall, "s", "-", None, note=_missing(tool)))
            continue
        wall = median([u.wall for u in results[tool]])
        cpu = median([u.cpu / gib for u in results[tool]])
        target = tool == "s5cmd"
        rows.append(
            Row(
                metric=f"  same, against {name} (wall)",
                baseline=wall,
                ours=ours_wall,
                unit="s",
                ratio=wall / ours_wall,
                target=">= 1.0x" if target else "info",
                ok=wall / ours_wall >= 1.0 if target else None,
                baseline_label=name,
                note=f"{name}: {cpu:.2f} CPU-s/GiB, peak RSS {max(u.maxrss for u in results[tool]):.0f} MiB",
                samples={tool: [u.wall for u in results[tool]]},
            )
        )
        rows.append(
            Row(
                metric=f"  same, client CPU per GiB against {name}",
                baseline=cpu,
                ours=ours_cpu,
                unit="cpu-s/GiB",
                ratio=ours_cpu / cpu,
                target="<= 1.3x" if target else "info",
                ok=ours_cpu / cpu <= 1.3 if target else None,
                baseline_label=name,
                samples={tool: [u.cpu / gib for u in results[tool]]},
            )
        )
    return rows


def _missing(tool: str) -> str:
    how = "install the AWS CLI" if tool == "aws" else "pip install 'ckptkeeper[bench]'"
    return f"skipped: {tool} is not installed ({how}, or put {tool} on PATH)"


def _prune_once(
    home: Path,
    pristine: Path,
    endpoint: str,
    prefix: str,
    env: dict[str, str],
    options: dict[str, object] | None = None,
) -> Usage:
    """``ckptkeeper prune`` of a fresh copy of ``pristine`` to ``s3://bench/<prefix>``, timed
    (``options``: more keys of the S3 tier's table, e.g. ``compression``)."""
    shutil.copytree(pristine, home / "hot", copy_function=shutil.copy2)
    for p in (home / "hot").rglob("*"):  # copytree's directory mtimes are new: settle them
        if p.is_dir():
            st = (pristine / p.relative_to(home / "hot")).stat()
            os.utime(p, (st.st_atime, st.st_mtime))
    lower: dict[str, object] = {
        "name": "cold",
        "url": f"s3://{BUCKET}/{prefix}",
        "storage_options": {"endpoint_url": endpoint, "key": "testing", "secret": "testing"},
        **(options or {}),
    }
    config = write_config(home, home / "hot", lower)
    usage = measure([sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "prune"], env)
    if any((home / "hot" / RUN).glob("checkpoint-*")):
        raise RuntimeError("prune left the checkpoint in hot")
    shutil.rmtree(home, ignore_errors=True)
    return usage


def _delete_prefix(endpoint: str, prefix: str) -> None:
    """Remove what one upload wrote (the server's disk holds one upload at a time)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **_CREDENTIALS)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def run(cfg: Config) -> list[Row]:
    reps = cfg.pick(cfg.reps, 3, 1)
    rows: list[Row] = []
    with cfg.tempdir(cfg.disk_dir, "restore-weed") as data, seaweedfs_server(data) as endpoint:
        for shape, label in (("large", "4 large files"), ("small", f"{cfg.pick(200, 60, 4)} small files")):
            rows += _shape(cfg, endpoint, shape, label, reps)
    return rows
