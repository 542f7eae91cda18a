"""A real ``ckptkeeper daemon`` subprocess on a temporary node, for the latency / idle / CPU-share
benchmarks, plus helpers to write checkpoints the way a trainer does."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._harness import python_env


def write_hf_checkpoint(run_dir: Path, step: int, payload: bytes, when: float | None = None) -> Path:
    """A small Hugging Face Trainer checkpoint directory (the layout is recognised on its own)."""
    ckpt = run_dir / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(_safetensors(payload))
    (ckpt / "trainer_state.json").write_text(
        json.dumps({"global_step": step, "log_history": [{"step": step, "eval_loss": 2.0 - step / 1e6}]})
    )
    if when is not None:
        for p in [*ckpt.rglob("*"), ckpt]:
            os.utime(p, (when, when))
    return ckpt


def _safetensors(payload: bytes) -> bytes:
    import struct

    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}
    ).encode()
    return struct.pack("<Q", len(header)) + header + payload


class DaemonProcess:
    """``python -m ckptkeeper.cli --config <tmp> daemon`` on ``hot`` (+ a warm tier), stopped with SIGTERM."""

    def __init__(
        self,
        root: Path,
        *,
        tiers: list[dict[str, Any]] | None = None,
        daemon: dict[str, Any] | None = None,
        nice: int = 0,
        hot: Path | None = None,
    ) -> None:
        self.root = root
        self.hot = hot or root / "hot"
        self.warm = root / "warm"
        self.index = root / "state" / "index.db"
        for p in (self.hot, self.warm, self.index.parent):
            p.mkdir(parents=True, exist_ok=True)
        self.tiers = tiers or [
            {"name": "hot", "url": str(self.hot)},  # no rules: keep everything, the jobs move nothing
            {"name": "warm", "url": str(self.warm)},
        ]
        # trees are back-dated to simulate settled checkpoints: judge them by mtime
        self.daemon = {"metrics_addr": "", "settle_seconds": 30, "trust_mtimes": True, **(daemon or {})}
        self.nice = nice
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "daemon.log"

    def _config(self) -> Path:
        lines = [f"index = {json.dumps(str(self.index))}", "max_delete = 1000000", "", "[daemon]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in self.daemon.items()]
        for tier in self.tiers:
            lines += ["", "[[tiers]]"] + [f"{k} = {json.dumps(v)}" for k, v in tier.items()]
        path = self.root / "config.toml"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)
        return path

    def start(self, *, ready_timeout: float = 120.0) -> None:
        config = self._config()
        nice = self.nice

        def preexec() -> None:  # deploy/ckptkeeper.service: Nice=10, IOSchedulingClass=best-effort, prio 7
            if nice:
                os.nice(nice)
                _ionice_lowest_best_effort()

        env = python_env()
        env.pop("CKPTKEEPER_CONFIG", None)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "daemon"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=preexec if nice else None,
            )
        deadline = time.monotonic() + ready_timeout
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"daemon not ready after {ready_timeout} s: {self.log.read_text()[-3000:]}"
                )
            time.sleep(0.1)

    def _ready(self) -> bool:
        """The daemon logs ``ready`` once the initial scan is done and the jobs are scheduled."""
        try:
            return b'"ready"' in self.log.read_bytes() or b" ready" in self.log.read_bytes()
        except OSError:
            return False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _ionice_lowest_best_effort() -> None:
    """ioprio_set(IOPRIO_WHO_PROCESS, self, best-effort class 2, level 7), as the unit file sets."""
    import ctypes
    import platform

    if platform.machine() != "x86_64":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(251, 1, 0, (2 << 13) | 7)  # 251 = SYS_ioprio_set on x86_64
    except OSError:
        pass


def open_index_readonly(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10, check_same_thread=False)
    db.execute("PRAGMA busy_timeout = 10000")
    return db
