"""Start a measured process from a small one, and report its rusage (stdlib only, run with -S).

``ru_maxrss`` counts the largest image a process ever had, and on Linux that includes the image it
inherited at ``fork`` before ``exec``: a child spawned by the bench process (hundreds of MiB after
a few benchmarks) reports at least the bench's size, whatever it uses itself (a ``cp`` read
109 MiB). Spawned from this launcher instead, it inherits ~10 MiB. Usage:
``python -S -m bench._launch RESULT.json ARGV...``; the child keeps this process's stdin, stdout,
stderr and environment; RESULT.json gets ``{"wall", "cpu", "maxrss_kib", "status"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    result, argv = sys.argv[1], sys.argv[2:]
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: exec at once (nothing to run in a forked interpreter)
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    _, status, ru = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    with open(result, "w") as f:
        json.dump(
            {"wall": wall, "cpu": ru.ru_utime + ru.ru_stime, "maxrss_kib": ru.ru_maxrss, "status": status}, f
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
