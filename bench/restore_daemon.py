"""``ckptkeeper restore`` of a small checkpoint: served by the node's daemon against run alone.

For a small checkpoint a restore is mostly its fixed cost: the interpreter, pydantic, s3fs and the
catalog's imports, the config and the S3 client, before the first byte (~0.5 CPU-s). With a daemon
up, the CLI is a thin client of its restore socket and the daemon, which paid that once, does the
work (docs/daemon-restore.md).

One small HF checkpoint is pruned from a hot tmpfs tier to a moto S3 server with the real CLI; a
daemon runs that config. Then, alternating, ``ckptkeeper restore RUN --to DIR`` (served by the
daemon; the daemon's log must say so) and the same command with ``--no-daemon``, each a fresh
process measured from spawn to exit with ``os.wait4`` (wall, the client's CPU). The daemon's own
CPU per served restore (``/proc/<pid>/stat`` before and after) is in the note: what the node pays
in all.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench._harness import Config, MiB, Row, median, python_env, read_proc_cpu_seconds
from bench.prune_e2e import _random_bytes, _safetensors, measure, write_config
from bench.s3_transfer import _AWS_ENV, moto_server

BUCKET = "bench-daemon"
RUN = "run-a"
STEP = 100


def _make_checkpoint(hot: Path, size: int, files: int) -> int:
    rng = random.Random(31)
    ckpt = hot / RUN / f"checkpoint-{STEP}"
    ckpt.mkdir(parents=True)
    _safetensors(ckpt / "model.safetensors", size, rng)
    for k in range(files):
        with open(ckpt / f"extra-{k}.bin", "wb") as f:
            _random_bytes(f, size // 4, rng)
    (ckpt / "trainer_state.json").write_text(f'{{"global_step": {STEP}, "log_history": []}}')
    when = time.time() - 3600
    total = 0
    for p in [*ckpt.rglob("*"), ckpt]:
        total += p.stat().st_size if p.is_file() else 0
        os.utime(p, (when, when))
    return total


def _served(log: Path) -> int:
    count = 0
    for line in log.read_text(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("event") == "restore socket: served" and doc.get("exit") == 0:
            count += 1
    return count


def run(cfg: Config) -> list[Row]:
    reps = cfg.pick(max(cfg.reps, 5), 3, 1)
    env = {**python_env(), **_AWS_ENV}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # both sides run from cached bytecode
    env = {k: v for k, v in env.items() if not k.startswith("CKPTKEEPER_")}
    with cfg.tempdir(cfg.fast_dir, "restore-daemon") as home, moto_server(home) as endpoint:
        import boto3

        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        s3.create_bucket(Bucket=BUCKET)
        total = _make_checkpoint(home / "hot", cfg.pick(1 * MiB, 256 * 1024, 64 * 1024), 3)
        lower: dict[str, object] = {
            "name": "cold",
            "url": f"s3://{BUCKET}/ckpt",
            "storage_options": {"endpoint_url": endpoint, "key": "testing", "secret": "testing"},
        }
        config = write_config(home, home / "hot", lower)
        cli = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config)]
        measure([*cli, "prune"], env)
        log = home / "daemon.log"
        with open(log, "wb") as out:
            daemon = subprocess.Popen([*cli, "daemon"], stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 120
            while b'"ready"' not in log.read_bytes():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"daemon did not start: {log.read_text()[-3000:]}")
                time.sleep(0.1)
            dest = home / "restore"
            restore = [*cli, "restore", RUN, "--step", str(STEP), "--to", str(dest)]
            sides = {"alone": [*restore, "--no-daemon"], "daemon": restore}
            wall: dict[str, list[float]] = {k: [] for k in sides}
            cpu: dict[str, list[float]] = {k: [] for k in sides}
            server_cpu: list[float] = []
            order = list(sides)
            for i in range(reps):
                for name in order if i % 2 == 0 else order[::-1]:
                    shutil.rmtree(dest, ignore_errors=True)
                    before = read_proc_cpu_seconds(daemon.pid)
                    usage = measure(sides[name], env)
                    if name == "daemon":
                        server_cpu.append(read_proc_cpu_seconds(daemon.pid) - before)
                    wall[name].append(usage.wall)
                    cpu[name].append(usage.cpu)
                    got = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
                    if got != total:
                        raise RuntimeError(f"{name} restored {got} bytes of {total}")
                cfg.log(f"restore_daemon: round {i + 1} of {reps}")
            if _served(log) != reps:
                raise RuntimeError(f"the daemon served {_served(log)} restores of {reps}")
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
    w = {k: median(v) for k, v in wall.items()}
    c = {k: median(v) for k, v in cpu.items()}
    daemon_cpu = median(server_cpu)
    what = f"restore of a small checkpoint ({total / 1024:.0f} KiB, S3 on moto) served by the daemon"
    return [
        Row(
            metric=f"{what} (wall, whole CLI process)",
            baseline=w["alone"],
            ours=w["daemon"],
            unit="s",
            ratio=w["alone"] / w["daemon"],
            target=">= 2.0x",
            ok=w["alone"] / w["daemon"] >= 2.0,
            baseline_label="ckptkeeper restore --no-daemon",
            samples=wall,
        ),
        Row(
            metric="  same, client CPU",
            baseline=c["alone"],
            ours=c["daemon"],
            unit="cpu-s",
            ratio=c["daemon"] / c["alone"],
            target="<= 0.3x",
            ok=c["daemon"] <= 0.3 * c["alone"],
            baseline_label="--no-daemon",
            note=f"the daemon's CPU per served restore: {daemon_cpu:.3f} s "
            f"(client + daemon {c['daemon'] + daemon_cpu:.3f} s)",
            samples={**cpu, "daemon_process": server_cpu},
        ),
    ]
