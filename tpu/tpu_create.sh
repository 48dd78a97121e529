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
#   QUEUED=1         request it as a queued resource, then wait until it is ACTIVE (it waits for capacity), printing
#                    each state it passes (WAITING_FOR_RESOURCES, PROVISIONING, ...); fails if it ends SUSPENDED or
#                    FAILED, naming the state
#   WAIT_TIMEOUT     with QUEUED=1, seconds to wait for ACTIVE (default 86400; 0: return once it is queued); the
#                    request stays queued after a timeout (tpu/tpu_delete.sh withdraws it)
#   WAIT_INTERVAL    seconds between two looks at its state (default 30)
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
spot=()
[[ "${SPOT:-0}" == 1 ]] && spot=(--spot)

echo "creating TPU slice $TPU_NAME ($ACCELERATOR, $RUNTIME_VERSION) in $ZONE"
if [[ "${QUEUED:-0}" == 1 ]]; then
  run gcloud compute tpus queued-resources create "$TPU_NAME" --node-id="$TPU_NAME" --zone="$ZONE" \
    --accelerator-type="$ACCELERATOR" --runtime-version="$RUNTIME_VERSION" "${extra[@]}" "${spot[@]}"
  if [[ "${WAIT_TIMEOUT:-86400}" == 0 ]]; then
    echo "queued; it is ready when its state is ACTIVE:"
    echo "  gcloud compute tpus queued-resources describe $TPU_NAME --zone=$ZONE${PROJECT:+ --project=$PROJECT}"
  else
    wait_queued ACTIVE
    [[ "${DRY_RUN:-0}" == 1 ]] || echo "$TPU_NAME is ACTIVE"
  fi
else
  run gcloud compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" --accelerator-type="$ACCELERATOR" \
    --version="$RUNTIME_VERSION" "${extra[@]}" "${spot[@]}"
fi
