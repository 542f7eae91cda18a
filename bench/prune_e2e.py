"""What a user runs, timed whole: ``ckptkeeper prune`` and ``ckptkeeper restore`` as processes.

bench/s3_transfer.py and bench/tier_move.py time the storage layer inside a worker; a user runs
the CLI, which also imports, reads the config, recognises the hot tier, plans, journals, writes
manifests and commits the index. Here each side is one child process, started from
nothing (forked from a small launcher, ``bench/_launch.py``, so its peak RSS is its own), and its
whole life is read from ``os.wait4``: wall (spawn to exit), CPU
(user + system, every thread) and peak RSS (``ru_maxrss``).

* **prune → cold**: a hot dir of settled HF-style checkpoints, a config whose hot tier keeps none
  (``keep_last = 0``) and whose ``s3://`` tier keeps all, so the prune moves every checkpoint
  (copy → verify → commit → re-check the survivor → delete, journaled). Baseline: a ``python``
  process that imports boto3 and ``upload_file``s the same files (default ``TransferConfig``).
  One ``python -m moto.server`` process on 127.0.0.1, reset (empty, bucket recreated) before
  every run of either side; a fresh index and a fresh copy of the hot dir for every prune.
* **prune → warm**: the same, to a local warm tier on disk; baseline ``cp -r`` + ``sync`` of the
  copied files + ``rm -rf`` of the source (what a careful mover does), as one ``sh`` process.
* **restore from cold**: ``ckptkeeper restore RUN --step N --to DIR`` of the newest checkpoint
  against boto3 ``download_file`` of the same objects (ckptkeeper's manifest left out).

Two data shapes, since real checkpoints mix both: few large files (4 checkpoints x 2 files) and
many small ones (4 checkpoints x many files of 64 KiB-4 MiB, log-uniform). Hot data lives on
``cfg.fast_dir`` (tmpfs), the warm tier and moto's spill files on ``cfg.disk_dir``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench._harness import Config, MiB, Row, alternate, median, python_env, read_proc_cpu_seconds
from bench.s3_transfer import _AWS_ENV, _reset, moto_server

BUCKET = "bench"
RUN = "run-a"
STEPS = (100, 200, 300, 400)
MANIFEST = ".ckptkeeper-manifest.json"


@dataclass
class Usage:
    """One child process's whole life."""

    wall: float
    cpu: float
    maxrss: float  # MiB
    server_cpu: float = 0.0
    """CPU the moto server spent meanwhile (its requests cost it too: a client that sends more
    of them slows the run down without showing it in its own CPU)."""


def measure(argv: list[str], env: dict[str, str], *, cwd: Path | None = None) -> Usage:
    """Run ``argv`` through ``bench/_launch.py``: its own wall, CPU and peak RSS (``os.wait4`` of a
    process forked from the small launcher, not from this one: see that module's docstring)."""
    fd, result = tempfile.mkstemp(prefix="ckptkeeper-bench-launch-", suffix=".json")
    os.close(fd)
    launcher = [sys.executable, "-S", str(Path(__file__).with_name("_launch.py")), result]
    try:
        proc = subprocess.run(
            [*launcher, *argv],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            check=False,
        )
        doc = json.loads(Path(result).read_text() or "{}")
    finally:
        os.unlink(result)
    code = os.waitstatus_to_exitcode(doc["status"]) if "status" in doc else proc.returncode
    if proc.returncode != 0 or code != 0:
        out = proc.stdout.decode(errors="replace")[-3000:]
        raise RuntimeError(f"{argv[:4]} … exited {code}:\n{out}")
    return Usage(float(doc["wall"]), float(doc["cpu"]), doc["maxrss_kib"] / 1024)


def _safetensors(path: Path, size: int, rng: random.Random) -> None:
    """A valid safetensors file of ``size`` bytes (one F32 tensor of random bytes)."""
    header = b""
    for _ in range(2):  # the header's length depends on the payload's, which depends on it
        payload = max(4, (size - 8 - len(header)) // 4 * 4)
        header = json.dumps(
            {"w": {"dtype": "F32", "shape": [payload // 4], "data_offsets": [0, payload]}}
        ).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        _random_bytes(f, payload, rng)


def _random_bytes(f: object, n: int, rng: random.Random) -> None:
    block = os.urandom(4 * MiB)
    write = f.write  # type: ignore[attr-defined]
    while n:
        k = min(n, len(block))
        start = rng.randrange(0, len(block) - k + 1)
        write(block[start : start + k])
        n -= k


def make_hot(root: Path, shape: str, sizes: dict[str, int]) -> int:
    """``root/run-a/checkpoint-{100..400}``, settled an hour ago; returns the total bytes.

    ``large``: ``model.safetensors`` + ``optimizer.pt`` of ``sizes['large']`` bytes each;
    ``small``: ``sizes['files']`` files of 64 KiB-4 MiB (log-uniform) in nested dirs, one of them
    the safetensors the layout recognises."""
    rng = random.Random(17)
    when = time.time() - 3600
    total = 0
    for i, step in enumerate(STEPS):
        ckpt = root / RUN / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        if shape == "large":
            _safetensors(ckpt / "model.safetensors", sizes["large"], rng)
            with open(ckpt / "optimizer.pt", "wb") as f:
                _random_bytes(f, sizes["large"], rng)
        else:
            _safetensors(ckpt / "model.safetensors", 4 * MiB, rng)
            for k in range(sizes["files"] - 1):
                sub = ckpt / f"shard-{k % 8}"
                sub.mkdir(exist_ok=True)
                size = int(2 ** rng.uniform(16, 22))
                with open(sub / f"part-{k:04d}.bin", "wb") as f:
                    _random_bytes(f, size, rng)
        history = [{"step": step, "eval_loss": 2.0 - step / 1000}]
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
        for p in [*ckpt.rglob("*"), ckpt]:
            total += p.stat().st_size if p.is_file() else 0
            os.utime(p, (when + i, when + i))
    return total


def write_config(home: Path, hot: Path, lower: dict[str, object]) -> Path:
    """A config moving every checkpoint out of hot into ``lower`` (a tier table)."""

    def value(v: object) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {json.dumps(x)}" for k, x in v.items()) + " }"
        return json.dumps(v)

    lines = [
        f"index = {json.dumps(str(home / 'index.db'))}",
        "",
        "[daemon]",
        'settle_seconds = "1s"',
        "trust_mtimes = true",
        'metrics_addr = ""',
        "",
        "[[tiers]]",
        'name = "hot"',
        f"url = {json.dumps(str(hot))}",
        "keep_last = 0",
        "",
        "[[tiers]]",
        *(f"{k} = {value(v)}" for k, v in lower.items()),
    ]
    path = home / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


def _server_pid(url: str) -> int | None:
    """The pid of the ``python -m moto.server … -p PORT`` behind ``url`` (None: not found)."""
    port = url.rsplit(":", 1)[-1]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"moto.server" in argv and port.encode() in argv:
            return int(entry.name)
    return None


class Bench:
    """One data shape: a pristine hot tree, and fresh per-run homes on the fast and disk dirs."""

    def __init__(
        self, cfg: Config, fast: Path, disk: Path, url: str, shape: str, sizes: dict[str, int]
    ) -> None:
        self.cfg = cfg
        self.fast = fast
        self.disk = disk
        self.url = url
        self.server = _server_pid(url)
        self.pristine = fast / "pristine"
        self.total = make_hot(self.pristine, shape, sizes)
        self.env = {**python_env(), **_AWS_ENV}
        # Both sides run from cached bytecode, as an installed package and boto3 in site-packages
        # do: without it every ckptkeeper run compiled its ~100 modules again (0.1 CPU-s).
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.runs = 0
        self.results: dict[str, list[Usage]] = {}
        self.last_home: Path | None = None

    def _home(self) -> tuple[Path, Path]:
        """A fresh home (index, config) and hot tier holding a copy of the pristine tree."""
        self.runs += 1
        home = self.fast / f"home-{self.runs}"
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir()
        shutil.copytree(self.pristine, home / "hot", copy_function=shutil.copy2)
        for p in [*(home / "hot").rglob("*")]:  # copytree's directory mtimes are new: settle them
            if p.is_dir():
                st = (self.pristine / p.relative_to(home / "hot")).stat()
                os.utime(p, (st.st_atime, st.st_mtime))
        return home, home / "hot"

    def _measure(self, argv: list[str]) -> Usage:
        """:func:`measure`, plus the moto server's CPU over the same span."""
        before = read_proc_cpu_seconds(self.server) if self.server else 0.0
        usage = measure(argv, self.env)
        if self.server:
            usage.server_cpu = read_proc_cpu_seconds(self.server) - before
        return usage

    def _record(self, label: str, usage: Usage) -> float:
        self.results.setdefault(label, []).append(usage)
        return usage.wall

    def _cleanup(self) -> None:
        for p in self.fast.glob("home-*"):
            if p != self.last_home:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.disk.glob("warm-*"):
            shutil.rmtree(p, ignore_errors=True)

    # -- prune to cold ---------------------------------------------------------------------

    def prune_cold(self) -> float:
        self._cleanup()
        _reset(self.url)
        home, hot = self._home()
        lower: dict[str, object] = {
            "name": "cold",
            "url": f"s3://{BUCKET}/ckpt",
            "storage_options": {"endpoint_url": self.url, "key": "testing", "secret": "testing"},
        }
        config = write_config(home, hot, lower)
        usage = self._measure([sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "prune"])
        if any((hot / RUN).glob("checkpoint-*")):
            raise RuntimeError(f"prune left checkpoints in hot: {sorted(os.listdir(hot / RUN))}")
        self.last_home = home
        return self._record("ckptkeeper prune cold", usage)

    def upload_boto3(self) -> float:
        self._cleanup()
        _reset(self.url)
        usage = self._measure(
            [
                sys.executable,
                "-m",
                "bench._boto3_job",
                "upload",
                self.url,
                BUCKET,
                "boto3",
                str(self.pristine),
            ]
        )
        return self._record("boto3 upload", usage)

    # -- prune to warm ---------------------------------------------------------------------

    def prune_warm(self) -> float:
        self._cleanup()
        home, hot = self._home()
        warm = self.disk / f"warm-{self.runs}"
        warm.mkdir()
        config = write_config(home, hot, {"name": "warm", "url": str(warm)})
        os.sync()  # the copy's dirty pages (none on tmpfs) and earlier runs' writeback stay out
        usage = measure([sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "prune"], self.env)
        if any((hot / RUN).glob("checkpoint-*")):
            raise RuntimeError("prune left checkpoints in hot")
        shutil.rmtree(home, ignore_errors=True)
        return self._record("ckptkeeper prune warm", usage)

    def cp_warm(self) -> float:
        self._cleanup()
        home, hot = self._home()
        warm = self.disk / f"warm-{self.runs}"
        warm.mkdir()
        os.sync()
        src, dst = hot / RUN, warm / RUN
        script = 'cp -r "$1" "$2" && find "$2" -type f -exec sync {} + && rm -rf "$1"'
        usage = measure(["sh", "-c", script, "sh", str(src), str(dst)], self.env)
        shutil.rmtree(home, ignore_errors=True)
        return self._record("cp -r + sync + rm", usage)

    # -- restore from cold -----------------------------------------------------------------

    def restore(self) -> float:
        assert self.last_home is not None
        dest = self.fast / "restore"
        shutil.rmtree(dest, ignore_errors=True)
        config = self.last_home / "config.toml"
        argv = [
            sys.executable,
            "-m",
            "ckptkeeper.cli",
            "--config",
            str(config),
            "restore",
            RUN,
            "--step",
            str(STEPS[-1]),
            "--to",
            str(dest),
        ]
        usage = self._measure(argv)
        return self._record("ckptkeeper restore", usage)

    def download_boto3(self) -> float:
        dest = self.fast / "restore"
        shutil.rmtree(dest, ignore_errors=True)
        prefix = f"ckpt/{RUN}/checkpoint-{STEPS[-1]}"
        usage = self._measure(
            [
                sys.executable,
                "-m",
                "bench._boto3_job",
                "download",
                self.url,
                BUCKET,
                prefix,
                str(dest),
                MANIFEST,
            ]
        )
        return self._record("boto3 download", usage)

    def restored_bytes(self) -> int:
        dest = self.fast / "restore"
        return sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())


def _rows(
    what: str,
    base: list[Usage],
    ours: list[Usage],
    baseline_label: str,
    *,
    wall_target: float | None,
    cpu_target: float | None,
    rss_target: bool,
    note: str = "",
) -> list[Row]:
    """Three rows (wall, CPU, peak RSS) for one comparison."""
    bw, ow = median([u.wall for u in base]), median([u.wall for u in ours])
    bc, oc = median([u.cpu for u in base]), median([u.cpu for u in ours])
    br, orss = max(u.maxrss for u in base), max(u.maxrss for u in ours)
    wall_ratio, cpu_ratio = bw / ow, oc / bc
    bs, os_ = median([u.server_cpu for u in base]), median([u.server_cpu for u in ours])
    if bs or os_:
        server = f"moto server CPU per run {os_:.2f} s vs {bs:.2f} s for the baseline"
        note = f"{note}; {server}" if note else server
    return [
        Row(
            metric=f"{what} (wall, whole process)",
            baseline=bw,
            ours=ow,
            unit="s",
            ratio=wall_ratio,
            target=f">= {wall_target}x" if wall_target is not None else "info",
            ok=None if wall_target is None else wall_ratio >= wall_target,
            baseline_label=baseline_label,
            note=note,
            samples={"baseline": [u.wall for u in base], "ckptkeeper": [u.wall for u in ours]},
        ),
        Row(
            metric="  same, CPU (user + sys, whole process)",
            baseline=bc,
            ours=oc,
            unit="CPU-s",
            ratio=cpu_ratio,
            target=f"<= {cpu_target}x" if cpu_target is not None else "info",
            ok=None if cpu_target is None else cpu_ratio <= cpu_target,
            baseline_label=baseline_label.split(" ")[0],
            samples={"baseline": [u.cpu for u in base], "ckptkeeper": [u.cpu for u in ours]},
        ),
        Row(
            metric="  same, peak RSS",
            baseline=br,
            ours=orss,
            unit="MiB",
            ratio=orss / br,
            target="<= baseline" if rss_target else "info",
            ok=(orss <= br) if rss_target else None,
            baseline_label=baseline_label.split(" ")[0],
            samples={"baseline": [u.maxrss for u in base], "ckptkeeper": [u.maxrss for u in ours]},
        ),
    ]


def shapes(cfg: Config) -> list[tuple[str, str, dict[str, int]]]:
    large = cfg.pick(256 * MiB, 32 * MiB, 1 * MiB)
    files = cfg.pick(200, 40, 4)
    return [
        ("large", f"4 ckpts x 2 x {large // MiB} MiB", {"large": large}),
        ("small", f"4 ckpts x {files} files of 64 KiB-4 MiB", {"files": files}),
    ]


def run(cfg: Config, *, only: tuple[str, ...] = ("cold", "warm", "restore")) -> list[Row]:
    reps = cfg.pick(cfg.reps, 3, 1)
    rows: list[Row] = []
    with (
        cfg.tempdir(cfg.disk_dir, "prune-server") as server_tmp,
        moto_server(server_tmp) as url,
    ):
        for shape, label, sizes in shapes(cfg):
            with (
                cfg.tempdir(cfg.fast_dir, f"prune-{shape}") as fast,
                cfg.tempdir(cfg.disk_dir, f"prune-{shape}") as disk,
            ):
                b = Bench(cfg, fast, disk, url, shape, sizes)
                size = f"{label}, {b.total / MiB:.0f} MiB"
                cfg.log(f"prune_e2e {size}")
                if "cold" in only or "restore" in only:
                    alternate(b.upload_boto3, b.prune_cold, reps, log=cfg.log)
                    rows += _rows(
                        f"prune hot→cold, {size}",
                        b.results["boto3 upload"],
                        b.results["ckptkeeper prune cold"],
                        "boto3 upload_file",
                        wall_target=1.0,
                        cpu_target=0.8,
                        rss_target=True,
                        note="`ckptkeeper prune` (copy, verify, commit, survivor re-check, delete) vs a "
                        "python process uploading the same files; one local moto server",
                    )
                if "restore" in only:
                    alternate(b.download_boto3, b.restore, reps, log=cfg.log)
                    rows += _rows(
                        "restore from cold, 1 ckpt of the above",
                        b.results["boto3 download"],
                        b.results["ckptkeeper restore"],
                        "boto3 download_file",
                        wall_target=1.0,
                        cpu_target=None,
                        rss_target=False,
                        note=f"{b.restored_bytes() / MiB:.0f} MiB (the newest checkpoint); ckptkeeper streams one GET per "
                        "object and re-hashes it, boto3 splits objects over 8 MiB into ranged GETs",
                    )
                if "warm" in only:
                    alternate(b.cp_warm, b.prune_warm, reps, log=cfg.log)
                    rows += _rows(
                        f"prune hot→warm (tmpfs→disk), {size}",
                        b.results["cp -r + sync + rm"],
                        b.results["ckptkeeper prune warm"],
                        "cp -r + sync + rm",
                        wall_target=0.95,
                        cpu_target=None,
                        rss_target=False,
                    )
    return rows
