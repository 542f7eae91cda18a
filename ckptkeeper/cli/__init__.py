"""The ``ckptkeeper`` command line: click commands that parse, call one action and render.

``ckptkeeper.cli:main`` is the console script; ``python -m ckptkeeper.cli`` runs it too.
"""

from ckptkeeper.cli.app import main

__all__ = ["main"]
