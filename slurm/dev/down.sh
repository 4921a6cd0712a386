#!/usr/bin/env bash
# Stop the dev Slurm cluster that slurm/dev/up.sh started: the two slurmd, slurmctld, slurmdbd,
# mariadbd and munged, each by the pid it wrote under the state folder (never by name), waiting
# for each to exit. Jobs still in the cluster are cancelled first so no job step outlives its slurmd.
# Idempotent; the state folder ($AREAL_SLURM_STATE, default /tmp/areal-slurm) is kept: up.sh reuses it.
set -euo pipefail
cd "$(dirname "$0")"
source ./lib.sh
T0=$(now)

if pid_of slurmctld >/dev/null && command -v squeue >/dev/null; then
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ' || true)
    if [[ -n ${jobs// /} ]]; then
        echo "  cancelling jobs $jobs"
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs 2>/dev/null || true
        for ((i = 0; i < 200; i++)); do  # up to 20 s (KillWait is 5 s)
            [[ -z $(timeout 10 squeue -h -o %A 2>/dev/null) ]] && break
            sleep 0.1
        done
    fi
fi

for node in "${NODES[@]}"; do stop_daemon "slurmd-$node"; done
for name in slurmctld slurmdbd mariadbd munged; do stop_daemon "$name"; done
echo "dev Slurm cluster $CLUSTER down ($(since "$T0") s); state kept in $STATE"
