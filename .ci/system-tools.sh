#!/usr/bin/env bash
# Installs, from Debian's packages, what the tests that use real system programs need:
#   SLURM + MUNGE (tests/launch/test_slurm.py starts a one-host cluster from a temp dir: no daemon is started
#   here), OpenMPI (tests/launch/test_cluster.py: mpirun), and headless Chromium with its driver
#   (tests/docs/test_docs.py renders the documentation site and uses its search box).
# Not root or no apt-get: says what skips and exits 0. Root with apt-get: failing to install is an error.
set -euo pipefail

TOOLS=(slurmctld slurmd srun sbatch sinfo scontrol munged mpirun chromium chromedriver)
PACKAGES=(slurmctld slurmd slurm-client munge openmpi-bin chromium chromium-driver)

missing=()
for tool in "${TOOLS[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "system-tools: SLURM, MUNGE, mpirun and headless Chromium already installed"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "system-tools: not root: the SLURM, mpirun and browser tests will skip (missing: ${missing[*]}; as root on Debian: make system-tools)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-tools: no apt-get: the SLURM, mpirun and browser tests will skip (missing: ${missing[*]}; install: ${PACKAGES[*]})"
    exit 0
fi

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >"$log" 2>&1
}

echo "system-tools: installing ${PACKAGES[*]} (missing: ${missing[*]})"
start=$SECONDS
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! apt_install; then
    echo "system-tools: apt-get install failed; running apt-get update and trying once more"
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$log" 2>&1 && apt_install; }; then
        tail -n 30 "$log" >&2
        echo "system-tools: ERROR: could not install ${PACKAGES[*]} with apt-get (output above)" >&2
        exit 1
    fi
fi

still=()
for tool in "${TOOLS[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || still+=("$tool")
done
if [ ${#still[@]} -ne 0 ]; then
    echo "system-tools: ERROR: installed ${PACKAGES[*]} but ${still[*]} still not on PATH" >&2
    exit 1
fi

versions=$(dpkg-query -W -f='${Package} ${Version}, ' "${PACKAGES[@]}")
echo "system-tools: installed ${versions%, } in $((SECONDS - start)) s"
