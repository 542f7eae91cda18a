"""Tier moves through the real executor (journal, copy → verify → commit → delete) against the
shell commands a cron job would use.

* across filesystems: hot on tmpfs (``/dev/shm``, the NVMe stand-in) → warm on disk. Baseline:
  ``cp -r`` + ``sync`` of every copied file (a safe mover makes the copy durable before it deletes
  the source) + ``rm -rf`` of the source. ckptkeeper: ``Executor.apply`` of a copy + delete plan,
  i.e. ``LocalTierStorage.copy_from`` (one read → hash → write pass, source checked against its
  manifest, files and directories fsync-ed, manifest, atomic rename) and ``delete``.
* ``ckptkeeper prune`` as a user runs it, a whole process (start-up, catalog, plan, the copy that
  hashes a new checkpoint on the way, journal, re-check, delete) moving a new checkpoint tmpfs →
  disk, against ``cp -r`` + ``sync`` + ``rm -rf``; and what it reads per byte moved: ``rchar`` of
  the whole process from ``/proc/<pid>/io``, read while it is a zombie (before this change: 2.0x,
  the catalog's hash and then the copy). Run as installed: bytecode compiled, after a warm-up.
  At least 7 rounds, each a pair taken back to back in alternating order; the row's ratio is the
  median of the pairs' ratios (the ratio of the medians, the range and the load average are in
  its note): on a shared box a change of load then hits both sides of a pair.
* same filesystem: hot and warm on disk. Baseline: ``mv`` + ``sync`` of both parent directories,
  the durable equivalent of what the executor does (a bare ``mv`` flushes nothing and
  is shown for information only). ckptkeeper: the executor's rename path. The three sides rotate
  order every round (median of 15 in a full run).
* the re-check of the survivor: before the delete of a move, every other copy is
  checked in storage against the manifest (for S3 a GET of the manifest and one listing of the
  checkpoint's prefix; a HEAD only for an object the listing does not show as expected).
  Measured against what it guards, a hot → cold move through the executor (upload, verify,
  commit, re-check, delete) on a moto server in its own process: the executor has no switch to
  turn the re-check off, so its call is timed inside that very move and the requests it sends
  counted on the cold client (botocore's ``before-send`` event). And, for a checkpoint of many
  small objects, the re-check against what it did before issue 17's change: a HEAD per object,
  16 in flight (``before-call`` counts the requests of both).

The checkpoint is a Hugging Face Trainer directory: two large tensors files and the usual small
files. Before each measurement the source is recreated from a template (untimed, mtimes kept so
it is settled) and dirty pages are flushed, so one side's writeback never lands in the other's
window.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

from bench._harness import Config, MiB, Row, alternate, median, python_env

RUN = "run-a"
CKPT = "checkpoint-1000"


def make_template(root: Path, total_bytes: int) -> Path:
    """An HF checkpoint of about ``total_bytes``: model + optimizer + the small files."""
    ckpt = root / CKPT
    ckpt.mkdir(parents=True)
    big = total_bytes - 64 * 1024
    sizes = {"model.safetensors": big * 2 // 5, "optimizer.pt": big - big * 2 // 5}
    chunk = os.urandom(4 * MiB)
    for name, size in sizes.items():
        with open(ckpt / name, "wb") as f:
            left = size
            if name.endswith(".safetensors"):  # a valid header: the recognizer checks it
                n = size - 1024
                header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
                header += b" " * (1024 - 8 - len(header))
                f.write(struct.pack("<Q", len(header)) + header)
                left -= 1024
            while left > 0:
                n = min(left, len(chunk))
                f.write(chunk[:n])
                left -= n
                chunk = chunk[1:] + chunk[:1]  # vary the content so no layer can deduplicate it
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    state = {"global_step": 1000, "log_history": [{"step": 1000, "eval_loss": 1.5}]}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "rng_state.pth").write_bytes(os.urandom(14 * 1024))
    (ckpt / "scheduler.pt").write_bytes(os.urandom(1064))
    (ckpt / "training_args.bin").write_bytes(os.urandom(5 * 1024))
    old = time.time() - 3 * 3600  # settled long ago: the catalog takes it as complete
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (old, old))
    return ckpt


def _files(path: Path) -> list[str]:
    return sorted(str(p) for p in path.rglob("*") if p.is_file())


def _settings(hot: Path, warm: Path, index: Path) -> object:
    from ckptkeeper.config import settings_from_mapping

    return settings_from_mapping(
        {
            "index": str(index),
            "tiers": [
                {"name": "hot", "url": str(hot), "keep_last": 1},
                {"name": "warm", "url": str(warm), "keep_last": 10},
            ],
            "daemon": {"metrics_addr": "", "trust_mtimes": True},  # back-dated checkpoint
        }
    )


class _Mover:
    """One hot → warm pair of tier roots with a fresh index per measurement."""

    def __init__(self, cfg: Config, template: Path, hot: Path, warm: Path, state: Path) -> None:
        self.cfg = cfg
        self.template = template
        self.hot = hot
        self.warm = warm
        self.state = state
        self.src = hot / RUN / CKPT
        self.rename_back = False

    def reset(self) -> None:
        moved = self.warm / RUN / CKPT
        if self.rename_back and moved.is_dir():  # same filesystem: undo the move, no recopy
            shutil.rmtree(self.state, ignore_errors=True)
            self.state.mkdir(parents=True)
            os.rename(moved, self.src)
            shutil.rmtree(self.warm)
            self.warm.mkdir()
            (self.warm / RUN).mkdir()  # a run's first move also creates its dir: not measured
            os.sync()
            return
        for root in (self.hot, self.warm, self.state):
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
        (self.hot / RUN).mkdir()
        (self.warm / RUN).mkdir()
        subprocess.run(["cp", "-a", str(self.template), str(self.src)], check=True)
        os.sync()

    def ckptkeeper_move(self) -> float:
        from ckptkeeper.core.model import Action, ActionKind, Plan
        from ckptkeeper.executor import Executor
        from ckptkeeper.index import Index
        from ckptkeeper.ingest.catalog import Catalog

        self.reset()
        settings = _settings(self.hot, self.warm, self.state / "index.db")
        index = Index(self.state / "index.db")
        try:
            Catalog(settings, index).reconcile()  # hashes the source once, as the daemon does
            row = index.checkpoint(RUN, CKPT)
            assert row is not None and row.state.value == "complete", row
            path = f"{RUN}/{CKPT}"
            plan = Plan(
                actions=(
                    Action(ActionKind.COPY, "bench", RUN, 1000, "hot", "warm", path, row.bytes, "demote"),
                    Action(ActionKind.DELETE, "bench", RUN, 1000, "hot", None, path, row.bytes, "moved"),
                ),
                keep=(),
                reclaim_bytes={},
            )
            executor = Executor(index, settings.tier_specs(), trust_mtimes=settings.daemon.trust_mtimes)  # type: ignore[attr-defined]
            os.sync()
            t0 = time.perf_counter()
            result = executor.apply(plan)
            elapsed = time.perf_counter() - t0
        finally:
            index.close()
        if not result.ok or len(result.done) != 2:
            raise RuntimeError(f"executor move failed: {result.failed} {result.skipped}")
        assert not self.src.exists() and (self.warm / RUN / CKPT).is_dir()
        return elapsed

    def cp_move(self) -> float:
        self.reset()
        dst = self.warm / RUN / CKPT
        t0 = time.perf_counter()
        subprocess.run(["cp", "-r", str(self.src), str(dst)], check=True)
        subprocess.run(["sync", *_files(dst)], check=True)
        subprocess.run(["rm", "-rf", str(self.src)], check=True)
        return time.perf_counter() - t0

    def mv(self, *, durable: bool) -> float:
        self.reset()
        dst = self.warm / RUN / CKPT
        t0 = time.perf_counter()
        subprocess.run(["mv", str(self.src), str(dst)], check=True)
        if durable:
            subprocess.run(["sync", str(dst.parent), str(self.src.parent)], check=True)
        return time.perf_counter() - t0


def run(cfg: Config) -> list[Row]:
    size = cfg.pick(1024 * MiB, 512 * MiB, 8 * MiB)
    reps = cfg.pick(cfg.reps, 3, 1)
    rows: list[Row] = []
    with cfg.tempdir(cfg.fast_dir, "move-fast") as fast, cfg.tempdir(cfg.disk_dir, "move-disk") as disk:
        template = make_template(fast / "template", size)
        cross = _Mover(cfg, template, fast / "hot", disk / "warm", disk / "state")
        base, ours = alternate(cross.cp_move, cross.ckptkeeper_move, reps, log=cfg.log)
        gib = size / 2**30
        rows.append(
            Row(
                metric=f"move hot→warm across filesystems, {size // MiB} MiB (tmpfs→disk)",
                baseline=median(base),
                ours=median(ours),
                unit="s",
                ratio=median(base) / median(ours),
                target=">= 0.95x",
                ok=median(base) / median(ours) >= 0.95,
                baseline_label="cp -r + sync + rm",
                note=f"ckptkeeper {gib / median(ours) * 1024:.0f} MiB/s incl. verification and journal",
                samples={"baseline": base, "ckptkeeper": ours},
            )
        )
        shutil.rmtree(fast / "hot", ignore_errors=True)

    rows.extend(prune_rows(cfg))
    rows.extend(same_fs_rows(cfg))
    rows.extend(cold_rows(cfg))
    return rows


def _run_measured(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Run ``argv`` to its end: (wall seconds, ``rchar`` of the whole process from
    ``/proc/<pid>/io``, read while it is a zombie, before it is reaped; stdout)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    elapsed = time.perf_counter() - t0
    with open(f"/proc/{proc.pid}/io") as f:
        rchar = int(next(line.split()[1] for line in f if line.startswith("rchar:")))
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}: {err.decode()[-2000:]}")
    return elapsed, rchar, out.decode()


class _PruneMover:
    """``ckptkeeper prune`` as a user runs it (a whole process: start-up, catalog, plan, copy,
    delete) moving one new checkpoint from hot (tmpfs) to warm (disk), against ``cp -r`` + ``sync``
    + ``rm -rf`` of the same directory. The index exists already (``scan`` before the checkpoints
    are written); the run's newest checkpoint, which stays in hot, is a small one, so that what
    the process reads from hot is what it moves plus the catalog's reads of small files."""

    def __init__(self, template: Path, newest: Path, hot: Path, warm: Path, state: Path) -> None:
        self.template = template
        self.newest = newest
        self.hot = hot
        self.warm = warm
        self.state = state
        self.src = hot / RUN / CKPT
        self.moved = sum(p.stat().st_size for p in template.rglob("*") if p.is_file())
        self.rchar: list[float] = []
        self.cp_rchar: list[float] = []

    def _reset(self) -> Path:
        for root in (self.hot, self.warm, self.state):
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
        (self.hot / RUN).mkdir()
        (self.warm / RUN).mkdir()
        config = self.state / "ckptkeeper.toml"
        config.write_text(
            f"index = {json.dumps(str(self.state / 'index.db'))}\n"
            '[daemon]\nmetrics_addr = ""\ntrust_mtimes = true\n'
            f'[[tiers]]\nname = "hot"\nurl = {json.dumps(str(self.hot))}\nkeep_last = 1\n'
            f'[[tiers]]\nname = "warm"\nurl = {json.dumps(str(self.warm))}\nkeep_last = 10\n'
        )
        subprocess.run(
            [*_CLI, "--config", str(config), "scan"], env=_installed_env(), check=True, capture_output=True
        )
        subprocess.run(["cp", "-a", str(self.template), str(self.src)], check=True)
        subprocess.run(["cp", "-a", str(self.newest), str(self.hot / RUN / self.newest.name)], check=True)
        os.sync()
        return config

    def prune(self) -> float:
        config = self._reset()
        elapsed, rchar, _ = _run_measured(
            [*_CLI, "--config", str(config), "prune", "--json"], env=_installed_env()
        )
        if self.src.exists() or not (self.warm / RUN / CKPT).is_dir():
            raise RuntimeError("ckptkeeper prune did not move the checkpoint to warm")
        self.rchar.append(rchar / self.moved)
        return elapsed

    def cp(self) -> float:
        self._reset()
        dst = self.warm / RUN / CKPT
        t0 = time.perf_counter()
        _, rchar, _ = _run_measured(["cp", "-r", str(self.src), str(dst)])
        subprocess.run(["sync", *_files(dst)], check=True)
        subprocess.run(["rm", "-rf", str(self.src)], check=True)
        self.cp_rchar.append(rchar / self.moved)
        return time.perf_counter() - t0


_CLI = [sys.executable, "-m", "ckptkeeper.cli"]
PRUNE_ROUNDS = 7
"""Alternating rounds of the ``ckptkeeper prune`` row in a full run (``--reps`` may ask more)."""


def _installed_env() -> dict[str, str]:
    """:func:`python_env` as an installed ckptkeeper runs: its bytecode compiled (pip does that at
    install; ``PYTHONDONTWRITEBYTECODE`` would make every process compile every module again)."""
    env = python_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def prune_rows(cfg: Config) -> list[Row]:
    """``ckptkeeper prune`` moving a new checkpoint to warm: wall against ``cp -r`` + ``sync``, and
    the bytes it reads from hot per byte moved (``rchar`` of the whole process; 2.0x before)."""
    size = cfg.pick(2048 * MiB, 512 * MiB, 8 * MiB)
    # Disk-bound and shared: every round is a pair taken back to back (flushed before each side),
    # so a change of load hits both sides of it; 7 pairs at least, their ratios' median decides.
    reps = cfg.pick(max(cfg.reps, PRUNE_ROUNDS), 3, 1)
    load_before = os.getloadavg()
    with cfg.tempdir(cfg.fast_dir, "prune-fast") as fast, cfg.tempdir(cfg.disk_dir, "prune-disk") as disk:
        template = make_template(fast / "template", size)
        newest = _small_newest(fast / "newest")
        mover = _PruneMover(template, newest, fast / "hot", disk / "warm", disk / "state")
        mover.prune()  # warm-up, untimed: writes the bytecode an installed ckptkeeper has
        mover.rchar.clear()
        # what a pass reads besides the checkpoint it moves (start-up, small files): a second pass
        # over the same tiers, with nothing left to move
        _, idle, _ = _run_measured(
            [*_CLI, "--config", str(mover.state / "ckptkeeper.toml"), "prune", "--json"], env=_installed_env()
        )
        base, ours = alternate(mover.cp, mover.prune, reps, log=cfg.log)
    load_after = os.getloadavg()
    rounds = [b / o for b, o in zip(base, ours, strict=True)]
    ratio = median(rounds)
    read = median(mover.rchar)
    return [
        Row(
            metric=f"ckptkeeper prune to warm, {size // MiB} MiB (tmpfs→disk), whole process",
            baseline=median(base),
            ours=median(ours),
            unit="s",
            ratio=ratio,
            target=">= 0.95x",
            ok=ratio >= 0.95,
            baseline_label="cp -r + sync + rm",
            note=f"median of {reps} rounds' ratios (each a pair back to back; ratio of the medians "
            f"{median(base) / median(ours):.2f}x, rounds {min(rounds):.2f}-{max(rounds):.2f}x); load average "
            f"{load_before[0]:.2f} before, {load_after[0]:.2f} after. Start-up, catalog, plan, copy (hashed "
            "on the way), journal, re-check, delete",
            samples={"baseline": base, "ckptkeeper": ours, "rounds": rounds},
        ),
        Row(
            metric="  same: bytes read from hot per byte moved (rchar of the process)",
            baseline=median(mover.cp_rchar),
            ours=read,
            unit="x",
            ratio=read,
            target="<= 1.0x (+ small files)",
            ok=read <= 1.02,
            baseline_label="cp -r",
            note=f"{median([r - idle / mover.moved for r in mover.rchar]):.4f}x net of the {idle / MiB:.1f} MiB a pass "
            "with nothing to move reads; 2.0x before: the catalog hashed every byte, then the copy read it again",
            samples={"baseline": mover.cp_rchar, "ckptkeeper": mover.rchar},
        ),
    ]


def _small_newest(root: Path) -> Path:
    """The run's newest checkpoint (what hot keeps): small, so the reads of the catalog's hash of
    it stay out of the bytes-per-byte-moved figure."""
    ckpt = root / "checkpoint-2000"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    state = {"global_step": 2000, "log_history": [{"step": 2000, "eval_loss": 1.4}]}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "training_args.bin").write_bytes(os.urandom(5 * 1024))
    old = time.time() - 3600  # settled, and newer than checkpoint-1000
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (old, old))
    return ckpt


def same_fs_rows(cfg: Config) -> list[Row]:
    """The rename path against ``mv`` + ``sync`` of both directories (a durable ``mv``: what a
    move that survives a power cut must wait for), and against a bare ``mv`` (info)."""
    size = cfg.pick(1024 * MiB, 512 * MiB, 8 * MiB)
    reps = cfg.pick(cfg.reps, 3, 1)
    rows: list[Row] = []
    with cfg.tempdir(cfg.disk_dir, "move-same") as disk:
        same_template = make_template(disk / "same-template", size)
        same = _Mover(cfg, same_template, disk / "s-hot", disk / "s-warm", disk / "s-state")
        same.rename_back = True
        rename_reps = max(3 * reps, 9) if not cfg.tiny else 1  # cheap, and fsync latency is noisy
        samples: dict[str, list[float]] = {"mv": [], "mv + sync dirs": [], "ckptkeeper": []}
        sides = [
            ("mv + sync dirs", lambda: same.mv(durable=True)),
            ("ckptkeeper", same.ckptkeeper_move),
            ("mv", lambda: same.mv(durable=False)),
        ]
        for i in range(rename_reps):  # rotate the order so drift hits every side alike
            for name, fn in sides[i % 3 :] + sides[: i % 3]:
                samples[name].append(fn())
            cfg.log(
                f"rename rep {i + 1}/{rename_reps}: "
                + ", ".join(f"{k} {v[-1] * 1e3:.2f} ms" for k, v in samples.items())
            )
        flush = _flush_latency(disk, rename_reps)
    base_sync, ours_mv, base_mv = samples["mv + sync dirs"], samples["ckptkeeper"], samples["mv"]
    ratio = median(base_sync) / median(ours_mv)
    rows.append(
        Row(
            metric=f"move hot→warm same filesystem (rename), {size // MiB} MiB",
            baseline=median(base_sync),
            ours=median(ours_mv),
            unit="s",
            ratio=ratio,
            target=">= 0.95x",
            ok=ratio >= 0.95,
            baseline_label="mv + sync of both dirs",
            note=(
                "durable on both sides; ckptkeeper also journals the move in SQLite and writes the manifest "
                f"beside the destination; one 4 KiB write + fsync takes {flush * 1e3:.2f} ms here (median)"
            ),
            samples={"baseline": base_sync, "ckptkeeper": ours_mv, "flush": [flush]},
        )
    )
    rows.append(
        Row(
            metric="  same, against a bare mv (flushes nothing: not durable)",
            baseline=median(base_mv),
            ours=median(ours_mv),
            unit="s",
            ratio=median(base_mv) / median(ours_mv),
            target="info",
            ok=None,
            baseline_label="mv",
            samples={"baseline": base_mv, "ckptkeeper": ours_mv},
        )
    )
    return rows


def _cold_settings(hot: Path, url: str, index: Path) -> object:
    from bench.s3_transfer import _AWS_ENV, BUCKET
    from ckptkeeper.config import settings_from_mapping

    options = {
        "endpoint_url": url,
        "key": _AWS_ENV["AWS_ACCESS_KEY_ID"],
        "secret": _AWS_ENV["AWS_SECRET_ACCESS_KEY"],
    }
    return settings_from_mapping(
        {
            "index": str(index),
            "tiers": [
                {"name": "hot", "url": str(hot), "keep_last": 1},
                {"name": "cold", "url": f"s3://{BUCKET}/ckpt", "storage_options": options},
            ],
            "daemon": {"metrics_addr": "", "trust_mtimes": True},  # cp -a: ctime is now, mtimes settled
        }
    )


class _ColdMover:
    """hot (tmpfs) → cold (moto) moves through the executor, and re-checks of the committed copy."""

    def __init__(self, template: Path, root: Path, url: str) -> None:
        self.name = template.name
        self.template = template
        self.root = root
        self.url = url
        self.hot = root / "hot"
        self.state = root / "state"
        self.requests = 0
        self.objects = 0
        self.in_move = 0.0
        """Seconds the last :meth:`move` spent in the executor's survivor re-check."""
        self.total_requests = 0
        """Requests the last :meth:`move` sent to the cold tier, all steps."""

    def _fresh(self) -> tuple[object, object]:
        from bench.s3_transfer import _reset
        from ckptkeeper.index import Index
        from ckptkeeper.ingest.catalog import Catalog

        _reset(self.url)
        for d in (self.hot, self.state):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        (self.hot / RUN).mkdir()
        subprocess.run(["cp", "-a", str(self.template), str(self.hot / RUN / self.name)], check=True)
        settings = _cold_settings(self.hot, self.url, self.state / "index.db")
        index = Index(self.state / "index.db")
        Catalog(settings, index).reconcile()
        return settings, index

    def move(self) -> float:
        """Copy + delete through the executor; the delete re-checks the cold copy first."""
        from ckptkeeper.core.model import Action, ActionKind, Plan
        from ckptkeeper.executor import Executor

        settings, index = self._fresh()
        try:
            row = index.checkpoint(RUN, self.name)  # type: ignore[attr-defined]
            assert row is not None and row.state.value == "complete", row
            path = f"{RUN}/{self.name}"
            plan = Plan(
                actions=(
                    Action(ActionKind.COPY, "bench", RUN, 1000, "hot", "cold", path, row.bytes, "demote"),
                    Action(ActionKind.DELETE, "bench", RUN, 1000, "hot", None, path, row.bytes, "moved"),
                ),
                keep=(),
                reclaim_bytes={},
            )
            executor = Executor(index, settings.tier_specs(), trust_mtimes=settings.daemon.trust_mtimes)  # type: ignore[arg-type, attr-defined]
            # The executor has no switch for the re-check (a delete always re-checks): its call is
            # timed inside this very move, and the requests it sends counted on the cold client.
            count = [0]

            def on_send(**_: object) -> None:
                count[0] += 1

            executor.storage("cold").fs.s3.meta.events.register("before-send.s3", on_send)  # type: ignore[attr-defined]
            recheck = executor._recheck_survivors
            spent = [0.0, 0.0]

            def timed(row: object, survivors: frozenset[str]) -> None:
                n0, t = count[0], time.perf_counter()
                try:
                    recheck(row, survivors)  # type: ignore[arg-type]
                finally:
                    spent[0] += time.perf_counter() - t
                    spent[1] += count[0] - n0

            executor._recheck_survivors = timed  # type: ignore[method-assign, assignment]
            t0 = time.perf_counter()
            result = executor.apply(plan)
            elapsed = time.perf_counter() - t0
        finally:
            index.close()  # type: ignore[attr-defined]
        if not result.ok or len(result.done) != 2:
            raise RuntimeError(f"executor move failed: {result.failed} {result.skipped}")
        if spent[1] == 0:
            raise RuntimeError("the move's delete sent no re-check request")
        self.in_move, self.requests = spent[0], int(spent[1])
        self.total_requests = count[0]
        return elapsed

    def recheck(self, *, head_each: bool = False) -> float:
        """One re-check of the committed cold copy (the move above left it), requests counted.

        ``head_each``: the re-check as it was before issue 17's change, a GET of the manifest and
        a HEAD per object, 16 in flight on the same client (the baseline of the small-objects row)."""
        import asyncio

        from fsspec.asyn import sync

        from ckptkeeper.core.model import Manifest
        from ckptkeeper.storage import S3TierStorage, TierStorage

        settings = _cold_settings(self.hot, self.url, self.state / "index.db")
        storage = TierStorage(settings.tier_specs()[1])  # type: ignore[attr-defined]
        assert isinstance(storage, S3TierStorage)
        manifest = storage.read_manifest(f"{RUN}/{self.name}")
        assert isinstance(manifest, Manifest)
        count = [0]

        def on_call(**_: object) -> None:
            count[0] += 1

        key = storage._key(f"{RUN}/{self.name}")

        async def heads() -> list[object]:
            sem = asyncio.Semaphore(16)

            async def one(method: str, k: str) -> object:
                async with sem:
                    return await storage.fs._call_s3(method, Bucket=storage.bucket, Key=k)

            keys = [f"{key}/{e.path}" for e in manifest.files]
            return await asyncio.gather(
                one("get_object", key + ".ckptkeeper-manifest.json"), *(one("head_object", k) for k in keys)
            )

        storage.fs.s3.meta.events.register("before-call.s3", on_call)
        t0 = time.perf_counter()
        if head_each:
            sync(storage.fs.loop, heads)
            problems: list[str] = []
        else:
            problems = storage.recheck(manifest)
        elapsed = time.perf_counter() - t0
        if problems:
            raise RuntimeError(f"re-check of an intact copy failed: {problems}")
        self.requests, self.objects = count[0], len(manifest.files)
        return elapsed


def _many_files_template(root: Path, n: int, size: int) -> Path:
    """A torch DCP directory of ``n`` shards (many objects per checkpoint)."""
    ckpt = root / "step_1000"
    ckpt.mkdir(parents=True)
    for i in range(n):
        (ckpt / f"__{i}_0.distcp").write_bytes(os.urandom(size))
    (ckpt / ".metadata").write_bytes(os.urandom(4096))
    old = time.time() - 3 * 3600
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (old, old))
    return ckpt


def cold_rows(cfg: Config) -> list[Row]:
    """The survivor re-check's cost: per move, and concurrent vs one request at a time."""
    from bench.s3_transfer import moto_server

    size = cfg.pick(1024 * MiB, 256 * MiB, 8 * MiB)
    reps = cfg.pick(cfg.reps, 3, 1)
    n_small = cfg.pick(200, 200, 20)
    rows: list[Row] = []
    with (
        cfg.tempdir(cfg.fast_dir, "recheck-fast") as fast,
        cfg.tempdir(cfg.disk_dir, "recheck-moto") as moto_tmp,
        moto_server(moto_tmp) as url,
    ):
        template = make_template(fast / "template", size)
        mover = _ColdMover(template, fast / "node", url)
        moves: list[float] = []
        checks: list[float] = []
        for i in range(reps):
            moves.append(mover.move())
            checks.append(mover.in_move)
            cfg.log(f"rep {i + 1}/{reps}: move {moves[-1]:.3f} s, re-check {checks[-1] * 1e3:.1f} ms")
        mover.objects = sum(1 for p in template.rglob("*") if p.is_file())
        ratio = median(checks) / median(moves)
        rows.append(
            Row(
                metric=f"survivor re-check before the hot delete of a move to cold, {size // MiB} MiB "
                f"({mover.objects} objects)",
                baseline=median(moves),
                ours=median(checks),
                unit="s",
                ratio=ratio,
                target="<= 0.05x",
                ok=ratio <= 0.05,
                baseline_label="the whole move (executor)",
                note=f"{mover.requests} extra requests per move (a GET of the manifest + one listing) of "
                f"{mover.total_requests} in all; {median(checks) / median(moves) * 100:.2f} % of the move's time, "
                "timed inside the executor's move",
                samples={"baseline": moves, "ckptkeeper": checks},
            )
        )
        shutil.rmtree(fast / "template", ignore_errors=True)

        small = _many_files_template(fast / "small-template", n_small, 64 * 1024)
        many = _ColdMover(small, fast / "node-small", url)
        many.move()

        def head_each() -> float:
            elapsed = many.recheck(head_each=True)
            counts["head_each"] = many.requests
            return elapsed

        def listing() -> float:
            elapsed = many.recheck()
            counts["listing"] = many.requests
            return elapsed

        counts: dict[str, int] = {}
        heads, listed = alternate(head_each, listing, reps, log=cfg.log)
        ratio = median(heads) / median(listed)
        rows.append(
            Row(
                metric=f"  same, {many.objects} small objects: the manifest and one listing",
                baseline=median(heads),
                ours=median(listed),
                unit="s",
                ratio=ratio,
                target="info",
                ok=None,
                baseline_label="a HEAD per object, 16 in flight",
                note=f"{counts['listing']} requests per re-check against {counts['head_each']}",
                samples={"baseline": heads, "ckptkeeper": listed},
            )
        )
    return rows


def _flush_latency(disk: Path, reps: int) -> float:
    """Median cost of one durable small write here: create a 4 KiB file, write, fsync (what each
    of the manifest and SQLite commits costs at least)."""
    d = disk / "fsync-probe"
    d.mkdir()
    times = []
    try:
        for i in range(max(reps, 5)):
            t0 = time.perf_counter()
            fd = os.open(d / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, b"x" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
            times.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return median(times)
