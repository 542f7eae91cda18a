"""``python -m bench._fixed_ranges SIZE ARGS...``: ``ckptkeeper ARGS...`` with every ranged GET of
a restore SIZE bytes, whatever the checkpoint (what sizing ranges per checkpoint is measured
against, :mod:`bench.restore_paced`)."""

from __future__ import annotations

import sys

from ckptkeeper.storage import s3_get

if __name__ == "__main__":
    size = int(sys.argv[1])
    s3_get.RANGE_SIZE = s3_get.LARGEST_RANGE = size
    sys.argv = ["ckptkeeper", *sys.argv[2:]]
    from ckptkeeper.cli.app import main

    main()
