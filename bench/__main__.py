"""``python -m bench``: run the benchmarks, print one table (and optionally JSON).

python -m bench                 # full run (large data, >= 5 alternating runs per ratio)
python -m bench --quick         # a few minutes: smaller data, 3 runs, shorter idle windows
python -m bench --only planning,campaign --json results.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from bench import BENCHMARKS
from bench._harness import Config, Row, machine, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a few minutes: smaller data, 3 runs")
    size.add_argument(
        "--tiny", action="store_true", help="smallest configuration (smoke tests; no meaningful timings)"
    )
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    parser.add_argument("--reps", type=int, default=5, help="alternating runs per ratio in full mode (>= 5)")
    parser.add_argument(
        "--json", metavar="PATH", help="also write rows + machine info as JSON ('-' = stdout)"
    )
    parser.add_argument("--fast-dir", default="/dev/shm", help="tmpfs standing in for the hot NVMe tier")
    parser.add_argument(
        "--disk-dir", default=None, help="a directory on a real disk (default: $TMPDIR or /tmp)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="progress and raw samples on stderr")
    args = parser.parse_args(argv)

    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    cfg = Config(
        mode="tiny" if args.tiny else "quick" if args.quick else "full",
        reps=max(args.reps, 1),
        fast_dir=Path(args.fast_dir),
        verbose=args.verbose,
    )
    if args.disk_dir:
        cfg.disk_dir = Path(args.disk_dir)

    info = machine()
    started = time.time()
    rows: list[Row] = []
    errors: list[str] = []
    for name in names:
        cfg.log(f"== {name}")
        t0 = time.perf_counter()
        try:
            module = importlib.import_module(f"bench.{name}")
            rows.extend(module.run(cfg))
        except Exception as exc:  # one broken benchmark must not hide the others' results
            traceback.print_exc()
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            rows.append(
                Row(
                    metric=f"{name} (error)",
                    baseline=None,
                    ours=None,
                    unit="",
                    target="-",
                    ok=False,
                    note=f"{type(exc).__name__}: {exc}",
                )
            )
        cfg.log(f"== {name} took {time.perf_counter() - t0:.0f} s")

    mode = {"full": "full run", "quick": "quick run (--quick)", "tiny": "tiny run (--tiny, smoke only)"}[
        cfg.mode
    ]
    print(
        f"ckptkeeper bench, {mode}: {info['nproc']} x {info['cpu']}, Linux {info['kernel']}, "
        f"Python {info['python']}, load {info['loadavg_at_start']}"
    )
    print()
    print(table(rows))
    if args.json:
        doc = {
            "mode": cfg.mode,
            "machine": info,
            "started": started,
            "seconds": time.time() - started,
            "rows": [r.to_dict() for r in rows],
            "errors": errors,
        }
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    failed = [r for r in rows if r.ok is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
