"""Many nodes, one bucket (DESIGN §10): finding any node's copies, node heartbeats, the fleet lease.

A layer of its own above ``storage`` (and ``config``), below ``executor``/``actions``: it speaks to the
object store only through :class:`~ckptkeeper.storage.S3TierStorage` and decides with pure
functions where it can. The object store is the only coordinator: no server, database or consensus
service of ours.

Modules: ``view`` (whose copies of a run are where, for ``restore`` from any node).
"""
