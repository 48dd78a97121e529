#!/usr/bin/env bash
# Runs one shell command on every worker of a TPU slice at once (gcloud ... ssh --worker=all), in the checkout.
#
# Usage: TPU_NAME=dreamjax ZONE=us-central2-b tpu/tpu_ssh.sh 'COMMAND'
#   e.g.  tpu/tpu_ssh.sh 'gcloud storage cp -r gs://BUCKET/Llama-3.1-8B-Instruct ~/checkpoints/'
#   TPU_NAME, ZONE, PROJECT, DRY_RUN=1   as for tpu/tpu_create.sh
#   REMOTE_DIR       the checkout on the workers (default: dreamjax, under the login's home)
#   WORKER           which workers (default: all; or one index, e.g. 0)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
if [[ $# -ne 1 ]]; then usage >&2; exit 2; fi
need TPU_NAME ZONE
extra=()
[[ -n "${PROJECT:-}" ]] && extra+=("--project=$PROJECT")
remote_dir="${REMOTE_DIR:-dreamjax}"

echo "on ${WORKER:-all} workers of $TPU_NAME, in ~/$remote_dir: $1"
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker="${WORKER:-all}" "${extra[@]}" \
  --command="mkdir -p ~/$remote_dir && cd ~/$remote_dir && $1"
