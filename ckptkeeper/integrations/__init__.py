"""Framework callbacks that drive :mod:`ckptkeeper.hook`.

Importing this package (or one of its modules) imports no framework: each module builds its
``KeeperCallback`` class on first attribute access, so ``ckptkeeper.integrations.lightning`` can be
imported where Lightning is absent. Install the extras ``ckptkeeper[lightning]`` / ``ckptkeeper[hf]``.
"""
