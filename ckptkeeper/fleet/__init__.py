"""Many nodes, one bucket (docs/design.md, "Many nodes"): finding any node's copies, node heartbeats, the fleet lease.

A layer of its own above ``storage`` (and ``config``), below ``executor``/``actions``: it speaks to the
object store only through :class:`~ckptkeeper.storage.S3TierStorage` and decides with pure
functions where it can. The object store is the only coordinator: no server, database or consensus
service of ours.

Modules: ``view`` (whose copies of a run are where, for ``restore`` from any node), ``lease``,
``nodes`` (heartbeats), ``cleanup`` (a gone node's litter), ``adopt`` (a gone node's copies under
the shared tier's rules), ``claims`` (one deleter per item, whoever stalls).
"""
