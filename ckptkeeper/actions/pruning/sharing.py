"""Participant: many nodes on one bucket cannot be half-configured
(:mod:`ckptkeeper.actions.tier_sharing`).

After the catalog, before anything is planned: copies another node wrote in an object-store tier
this node does not share are a config error (exit 2 naming ``tiers[i].shared``), in a dry run too.
"""

from __future__ import annotations

from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.actions.tier_sharing import refuse_unshared_writers


class UnsharedTiers(Participant):
    def catalog(self, state: PassState) -> None:
        refuse_unshared_writers(state.settings, state.index)  # raises TierNotShared
