"""``python -m ckptkeeper.cli``: the same entry point as the console script."""

from ckptkeeper.cli import run

run()
