"""What every benchmark shares: the result row, A/B alternation, medians, formatting, machine info.

Conventions: every target is a ratio against a baseline measured in the same run, on the
same data, alternating A/B (A,B then B,A, … so drift on a shared machine hits both sides alike),
median of ``reps`` runs. Absolute targets (latency, planning time, idle CPU) have no baseline of
their own; their row shows ``-`` there.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MiB = 2**20
GiB = 2**30


@dataclass
class Config:
    """How big and how often; one instance per ``python -m bench`` invocation."""

    mode: str = "full"
    """``full``, ``quick`` (a few minutes, smaller data) or ``tiny`` (smoke tests only)."""
    reps: int = 5
    fast_dir: Path = Path("/dev/shm")
    """The "hot NVMe" stand-in: tmpfs, another filesystem than ``disk_dir``."""
    disk_dir: Path = Path(tempfile.gettempdir())
    """A real disk for the warm tier."""
    verbose: bool = False

    @property
    def quick(self) -> bool:
        return self.mode != "full"

    @property
    def tiny(self) -> bool:
        return self.mode == "tiny"

    def pick(self, full: Any, quick: Any, tiny: Any | None = None) -> Any:
        if self.mode == "full":
            return full
        if self.mode == "tiny" and tiny is not None:
            return tiny
        return quick

    def log(self, message: str) -> None:
        if self.verbose:
            print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def tempdir(self, where: Path, prefix: str) -> Iterator[Path]:
        path = Path(tempfile.mkdtemp(prefix=f"ckptkeeper-bench-{prefix}-", dir=where))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


@dataclass
class Row:
    """One line of the table. ``ratio`` is oriented so that the target reads naturally
    (speed ratios: baseline time / our time, higher is better; cost ratios: ours / baseline)."""

    metric: str
    baseline: float | None
    ours: float | None
    unit: str
    target: str
    ok: bool | None
    """None: informational row, no target."""
    ratio: float | None = None
    baseline_label: str = ""
    note: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- measuring ---------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): p99 of 1000 samples is the 990th smallest."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no samples")
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return float(ordered[rank - 1])


def alternate(
    a: Callable[[], float],
    b: Callable[[], float],
    reps: int,
    *,
    log: Callable[[str], None] | None = None,
    names: tuple[str, str] = ("baseline", "ckptkeeper"),
) -> tuple[list[float], list[float]]:
    """Run ``a`` and ``b`` ``reps`` times each, alternating which goes first; each returns its
    own measurement (so untimed setup can live inside it)."""
    out_a: list[float] = []
    out_b: list[float] = []
    for i in range(reps):
        order = ((a, out_a, names[0]), (b, out_b, names[1]))
        if i % 2:
            order = order[::-1]
        for fn, out, name in order:
            value = fn()
            out.append(value)
            if log is not None:
                log(f"rep {i + 1}/{reps} {name}: {value:.4g}")
    return out_a, out_b


def drop_caches_best_effort() -> None:
    """Flush dirty pages so one measurement's writeback never lands in the next one's window."""
    os.sync()


def read_proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc/PID/stat, in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        text = f.read().decode()
    fields = text[text.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def read_proc_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def python_env() -> dict[str, str]:
    """Environment for Python subprocesses: this checkout first on the path, quiet, unbuffered."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_worker(module: str, payload: dict[str, Any], *, timeout: float = 1800) -> dict[str, Any]:
    """Run ``python -m <module>`` with ``payload`` as JSON on stdin; return its last stdout line
    parsed as JSON. Each worker is its own process, forked from the small ``bench/_launch.py``
    rather than from this one, so its CPU and peak RSS are its own (see that module)."""
    launcher = [sys.executable, "-S", str(Path(__file__).with_name("_launch.py")), os.devnull]
    proc = subprocess.run(
        [*launcher, sys.executable, "-m", module],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{module} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# -- presenting --------------------------------------------------------------------------------


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        if value < 1e-3:
            return f"{value * 1e6:.0f} µs"
        if value < 1:
            return f"{value * 1e3:.1f} ms"
        return f"{value:.2f} s"
    if unit == "ms":
        return f"{value:.3g} ms" if value < 10 else f"{value:.1f} ms"
    if unit == "MiB/s":
        return f"{value:.0f} MiB/s"
    if unit == "MiB":
        return f"{value:.0f} MiB"
    if unit == "GiB":
        return f"{value:.2f} GiB"
    if unit == "cpu-s/GiB":
        return f"{value:.2f} cpu-s/GiB"
    if unit == "%":
        return f"{value:.2f} %"
    if unit == "bool":
        return "yes" if value else "no"
    return f"{value:.4g} {unit}".rstrip()


def fmt_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def table(rows: Sequence[Row]) -> str:
    """One Markdown table (pasteable into the README as is)."""
    header = ["metric", "baseline", "ckptkeeper", "ratio", "target", "result"]
    body = []
    for r in rows:
        base = fmt_value(r.baseline, r.unit)
        if r.baseline_label and r.baseline is not None:
            base = f"{base} ({r.baseline_label})"
        elif r.baseline_label:
            base = r.baseline_label
        result = "info" if r.ok is None else ("pass" if r.ok else "FAIL")
        body.append([r.metric, base, fmt_value(r.ours, r.unit), fmt_ratio(r.ratio), r.target, result])
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out.extend(line(cells) for cells in body)
    notes = [f"- {r.metric}: {r.note}" for r in rows if r.note]
    if notes:
        out.append("")
        out.extend(notes)
    return "\n".join(out)


def machine() -> dict[str, str]:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for text in f:
            if text.startswith("model name"):
                model = text.split(":", 1)[1].strip()
                break
    load = "?"
    with contextlib.suppress(OSError), open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return {
        "nproc": str(os.cpu_count()),
        "cpu": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": load,
    }
