"""The ``ckptkeeper`` command line: click commands that parse, call one action and render.

``ckptkeeper.cli:run`` is the console script and ``python -m ckptkeeper.cli`` runs it too: a restore
the node's daemon serves is answered there without loading click (:mod:`.served`), everything else
by the command group, ``ckptkeeper.cli.main`` (loaded on first use); a plain ``restore ...
--no-daemon`` of a config validated before runs without click too (:mod:`.standalone`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptkeeper.cli.app import main

__all__ = ["main", "run"]


def run() -> None:
    import sys

    if "--no-daemon" in sys.argv:
        from ckptkeeper.cli import standalone
        from ckptkeeper.cli.served import _parse

        standalone.attempt(sys.argv[1:], _parse)
    from ckptkeeper.cli.served import run as served_run

    served_run()


def __getattr__(name: str) -> Any:
    if name == "main":
        from ckptkeeper.cli.app import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
