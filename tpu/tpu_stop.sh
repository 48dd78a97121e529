#!/usr/bin/env bash
# Stops a dreamjax run on every worker of a TPU slice (one started with DETACH=1 tpu/tpu_run.sh, or one left behind):
# SIGTERM to every dreamjax process, which saves a checkpoint and exits (rerunning the same command resumes from it),
# SIGKILL after GRACE seconds to what is left and to anything else holding a TPU device, then libtpu's lockfile
# (/tmp/libtpu_lockfile) removed, so the next run finds the TPU free.
#
# Usage: TPU_NAME=dreamjax ZONE=us-central2-b tpu/tpu_stop.sh
#   TPU_NAME, ZONE, PROJECT, DRY_RUN=1   as for tpu/tpu_create.sh
#   GRACE            seconds to wait for the processes to save and exit before killing them (default 300; 0: kill now)
#   WORKER           which workers (default: all; or one index, e.g. 0)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
need TPU_NAME ZONE
extra=()
[[ -n "${PROJECT:-}" ]] && extra+=("--project=$PROJECT")

echo "stopping dreamjax on ${WORKER:-all} workers of $TPU_NAME (up to ${GRACE:-300} s to save a checkpoint)"
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker="${WORKER:-all}" "${extra[@]}" \
  --command="$(free_tpu_command "${GRACE:-300}")"
