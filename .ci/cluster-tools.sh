#!/usr/bin/env bash
# Installs what the real-cluster tests need (tests/launch/test_slurm.py: a one-host SLURM cluster;
# tests/launch/test_cluster.py: mpirun) from Debian's packages. Starts no daemon: the SLURM test
# fixture starts its own munged/slurmctld/slurmd from a temp dir.
# Not root or no apt-get: says what skips and exits 0. Root with apt-get: failing to install is an error.
set -euo pipefail

TOOLS=(slurmctld slurmd srun sbatch sinfo scontrol munged mpirun)
PACKAGES=(slurmctld slurmd slurm-client munge openmpi-bin)

missing=()
for tool in "${TOOLS[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "cluster-tools: SLURM, MUNGE and mpirun already installed"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "cluster-tools: not root: the SLURM and mpirun tests will skip (missing: ${missing[*]}; as root on Debian: make cluster-tools)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "cluster-tools: no apt-get: the SLURM and mpirun tests will skip (missing: ${missing[*]}; install: ${PACKAGES[*]})"
    exit 0
fi

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >"$log" 2>&1
}

echo "cluster-tools: installing ${PACKAGES[*]} (missing: ${missing[*]})"
start=$SECONDS
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! apt_install; then
    echo "cluster-tools: apt-get install failed; running apt-get update and trying once more"
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$log" 2>&1 && apt_install; }; then
        tail -n 30 "$log" >&2
        echo "cluster-tools: ERROR: could not install ${PACKAGES[*]} with apt-get (output above)" >&2
        exit 1
    fi
fi

still=()
for tool in "${TOOLS[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || still+=("$tool")
done
if [ ${#still[@]} -ne 0 ]; then
    echo "cluster-tools: ERROR: installed ${PACKAGES[*]} but ${still[*]} still not on PATH" >&2
    exit 1
fi

versions=$(dpkg-query -W -f='${Package} ${Version}, ' "${PACKAGES[@]}")
echo "cluster-tools: installed ${versions%, } in $((SECONDS - start)) s"
