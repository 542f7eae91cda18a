#!/bin/bash
# Installs strace for tests/test_prune_syncs.py (what `ckptkeeper prune` flushes, and in which
# order, seen from outside the process); without it those tests skip. Idempotent.
set -euo pipefail
if command -v strace >/dev/null; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends strace >/dev/null
strace -V | head -1
