"""A CPU-bound stand-in trainer: ``python -m bench._trainer SECONDS`` runs a numpy loop on one
core (pinned to the last CPU, single-threaded BLAS) and prints the steps per second it achieved."""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    seconds = float(sys.argv[1])
    cpu = int(sys.argv[2]) if len(sys.argv) > 2 else (os.cpu_count() or 1) - 1
    os.sched_setaffinity(0, {cpu})
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 256), dtype=np.float32)
    b = rng.standard_normal((256, 256), dtype=np.float32)
    x = rng.standard_normal(1 << 20, dtype=np.float32)  # 4 MiB of "activations": cache traffic too
    steps = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        for _ in range(8):
            a = np.tanh(a @ b * 0.01)
            x *= 0.999
            x += 0.001
        steps += 1
        now = time.perf_counter()
        if now >= end:
            break
    print(f"{steps / (now - t0)}")


if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    main()
