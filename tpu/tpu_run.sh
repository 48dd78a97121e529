#!/usr/bin/env bash
# Runs one dreamjax command on every worker of a TPU slice at once, as one JAX process per worker: JAX finds the
# slice's other hosts itself (jax.distributed.initialize() reads the TPU metadata), so nothing else is configured.
#
# Usage: TPU_NAME=dreamjax ZONE=us-central2-b tpu/tpu_run.sh COMMAND CONFIG [--set KEY=VALUE ...]
#   e.g.  tpu/tpu_run.sh dreamgym configs/scale/dreamgym_llama3b_tpu.py --set rl.iterations=50
#   TPU_NAME, ZONE, PROJECT, DRY_RUN=1   as for tpu/tpu_create.sh
#   REMOTE_DIR       the checkout on the workers (default: dreamjax)
#   DETACH=1         start it in the background on the workers (nohup) and return; the log is then
#                    logs/COMMAND-<worker host>.log in the checkout (tpu/tpu_ssh.sh 'tail logs/*.log' shows it)
# Process 0 (worker 0) writes the run folder; checkpoints are written by every worker into the same out_dir, so for
# multi-host checkpoints out_dir must be a filesystem all workers share (tpu/README.md).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
if [[ $# -lt 2 ]]; then usage >&2; exit 2; fi
need TPU_NAME ZONE
command_name="$1" config="$2"
shift 2
check_config "$config"
extra=()
[[ -n "${PROJECT:-}" ]] && extra+=("--project=$PROJECT")
remote_dir="${REMOTE_DIR:-dreamjax}"

job=".venv/bin/dreamjax $command_name --config $config"
for arg in "$@"; do
  job+=" $(printf '%q' "$arg")"
done
log="logs/$command_name-\$(hostname).log"
if [[ "${DETACH:-0}" == 1 ]]; then
  job="nohup $job > $log 2>&1 < /dev/null &"
else
  job="$job 2>&1 | tee $log"
fi
echo "running on every worker of $TPU_NAME: dreamjax $command_name --config $config $*"
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all "${extra[@]}" \
  --command="set -o pipefail && cd ~/$remote_dir && mkdir -p logs && $job"
