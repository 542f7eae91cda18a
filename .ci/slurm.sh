#!/bin/bash
# Installs Debian's Slurm (slurmctld, slurmd, the client commands) for tests/test_slurm_jobs.py,
# which starts its own two-node cluster in a temp dir (auth/none: munge is installed, not used).
# Idempotent; about 20 s on a fresh machine, nothing when already installed.
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
slurmctld -V
