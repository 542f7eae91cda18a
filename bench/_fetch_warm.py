"""``python -m bench._fetch_warm CONFIG RUN STEP DEST REPS``: what a restore costs a process that is
already warm (imports done, config read, index open, S3 signing client built): the case of a
restore served by a long-running process such as the daemon.

One untimed restore warms the process up; then ``REPS`` restores of ``RUN@STEP`` into ``DEST``
(emptied before each), each timed alone: wall, and CPU of every thread of this process from
``getrusage`` (the same clock ``os.wait4`` reads for whole processes). Prints one JSON line:
``{"wall": [...], "cpu": [...]}``.
"""

from __future__ import annotations

import json
import resource
import shutil
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> None:
    config, run, step, dest, reps = argv[0], argv[1], int(argv[2]), Path(argv[3]), int(argv[4])
    from ckptkeeper.actions.index import open_index
    from ckptkeeper.actions.restore import restore_to
    from ckptkeeper.config import load_settings
    from ckptkeeper.storage import deadline

    settings = load_settings(config)
    deadline.configure(settings.request_timeout)
    walls: list[float] = []
    cpus: list[float] = []
    ix = open_index(settings, check=False, rebuild=False)
    try:
        for i in range(reps + 1):
            shutil.rmtree(dest, ignore_errors=True)
            before = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            restore_to(settings, ix, run, step, dest)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_SELF)
            if i:  # the first one warms the process up
                walls.append(wall)
                cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    finally:
        ix.close()
    print(json.dumps({"wall": walls, "cpu": cpus}))


if __name__ == "__main__":
    main(sys.argv[1:])
