#!/usr/bin/env bash
# Deletes a TPU slice made by tpu/tpu_create.sh (and its queued resource, with QUEUED=1): TPU time is billed until then.
#
# Usage: TPU_NAME=dreamjax ZONE=us-central2-b tpu/tpu_delete.sh
#   TPU_NAME, ZONE, PROJECT, QUEUED=1, DRY_RUN=1   as for tpu/tpu_create.sh
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
need TPU_NAME ZONE
extra=()
[[ -n "${PROJECT:-}" ]] && extra+=("--project=$PROJECT")

echo "deleting TPU slice $TPU_NAME in $ZONE"
if [[ "${QUEUED:-0}" == 1 ]]; then
  run gcloud compute tpus queued-resources delete "$TPU_NAME" --zone="$ZONE" --force --quiet "${extra[@]}"
else
  run gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone="$ZONE" --quiet "${extra[@]}"
fi
