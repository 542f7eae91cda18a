"""The prune pass (:mod:`.runner`), its participants (:mod:`.participants`) and the catalog a
caller chooses for it (:mod:`.catalog`)."""
