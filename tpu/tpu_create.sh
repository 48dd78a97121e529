#!/usr/bin/env bash
# Creates a Cloud TPU VM pod slice (all its hosts at once), directly or through a queued resource.
#
# Usage: TPU_NAME=dreamjax ZONE=us-central2-b ACCELERATOR=v4-64 tpu/tpu_create.sh
#   TPU_NAME         name of the slice (required)
#   ZONE             its zone, one that offers the accelerator (required)
#   ACCELERATOR      accelerator type: v4-64, v5p-32, v5litepod-16, v6e-16, ... (required)
#   RUNTIME_VERSION  TPU VM image; default by generation: v4 tpu-ubuntu2204-base, v5p v2-alpha-tpuv5,
#                    v5e (v5litepod) v2-alpha-tpuv5-lite, v6e v2-alpha-tpuv6e
#   PROJECT          gcloud project (default: the configured one)
#   QUEUED=1         request it as a queued resource (waits for capacity; watch it with the describe command printed)
#   SPOT=1           spot (preemptible) capacity
#   DRY_RUN=1        print the gcloud commands instead of running them
# Delete it when done: tpu/tpu_delete.sh (same variables).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
need TPU_NAME ZONE ACCELERATOR

if [[ -z "${RUNTIME_VERSION:-}" ]]; then
  case "$ACCELERATOR" in
    v4-*) RUNTIME_VERSION=tpu-ubuntu2204-base ;;
    v5p-*) RUNTIME_VERSION=v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) RUNTIME_VERSION=v2-alpha-tpuv5-lite ;;
    v6e-*) RUNTIME_VERSION=v2-alpha-tpuv6e ;;
    *) echo "tpu_create.sh: no default RUNTIME_VERSION for $ACCELERATOR; set it" >&2; exit 2 ;;
  esac
fi
extra=()
[[ -n "${PROJECT:-}" ]] && extra+=("--project=$PROJECT")
[[ "${SPOT:-0}" == 1 ]] && extra+=(--spot)

echo "creating TPU slice $TPU_NAME ($ACCELERATOR, $RUNTIME_VERSION) in $ZONE"
if [[ "${QUEUED:-0}" == 1 ]]; then
  run gcloud compute tpus queued-resources create "$TPU_NAME" --node-id="$TPU_NAME" --zone="$ZONE" \
    --accelerator-type="$ACCELERATOR" --runtime-version="$RUNTIME_VERSION" "${extra[@]}"
  echo "queued; it is ready when its state is ACTIVE:"
  echo "  gcloud compute tpus queued-resources describe $TPU_NAME --zone=$ZONE${PROJECT:+ --project=$PROJECT}"
else
  run gcloud compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" --accelerator-type="$ACCELERATOR" \
    --version="$RUNTIME_VERSION" "${extra[@]}"
fi
