"""``python -m ckptkeeper.cli``: the same command group as the console script."""

from ckptkeeper.cli.app import main

main()
