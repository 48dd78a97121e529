#!/usr/bin/env bash
# Runs one dreamjax command on every worker of a TPU slice at once, as one JAX process per worker: JAX finds the
# slice's other hosts itself (jax.distributed.initialize() reads the TPU metadata), so nothing else is configured.
# First it frees the TPU on every worker: it kills what is left of an earlier run (any dreamjax process and anything
# holding a TPU device) and removes libtpu's lockfile (/tmp/libtpu_lockfile), which would make the new run fail.
#
# Usage: TPU_NAME=dreamjax ZONE=us-central2-b tpu/tpu_run.sh COMMAND CONFIG [--set KEY=VALUE ...]
#   e.g.  tpu/tpu_run.sh dreamgym configs/scale/dreamgym_llama3b_tpu.py --set out_dir=runs/dreamgym_3b
#   TPU_NAME, ZONE, PROJECT, DRY_RUN=1   as for tpu/tpu_create.sh
#   REMOTE_DIR       the checkout on the workers (default: dreamjax)
#   WORKERS          the slice's worker count (default: read with gcloud compute tpus tpu-vm describe)
#   GRACE            seconds the workers get to save a checkpoint and exit when the run is stopped (default 120)
#   DETACH=1         start it in the background on the workers (nohup) and return; tpu/tpu_stop.sh stops it
# Each worker logs to <out_dir>/logs/COMMAND-<worker host>.log when the arguments set out_dir (--set out_dir=...),
# else to logs/ in the checkout; tpu/tpu_ssh.sh 'tail -n 3 <that folder>/*.log' shows them.
# Without DETACH, one ssh session per worker streams its output here (lines prefixed [worker N]); when one worker's
# command fails (or on Ctrl-C) the run is stopped on every worker (SIGTERM, GRACE seconds, SIGKILL), and the exit
# status is the failed worker's: 75 (PREEMPTED_EXIT in tpu/lib.sh) means stopped after saving a checkpoint, so the
# same command resumes. Process 0 (worker 0) writes the run folder; checkpoints are written by every worker into the
# same out_dir, so for multi-host checkpoints out_dir must be a filesystem all workers share (tpu/README.md).
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
grace="${GRACE:-120}"
ssh=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE")

job=".venv/bin/dreamjax $command_name --config $config"
log_dir=logs
previous=""
for arg in "$@"; do
  job+=" $(printf '%q' "$arg")"
  if [[ "$previous" == --set && "$arg" == out_dir=* ]]; then
    log_dir="$(printf '%q' "${arg#out_dir=}")/logs"
  fi
  previous="$arg"
done
log="$log_dir/$command_name-\$(hostname).log"
log_where="$log_dir"
[[ "$log_dir" == /* ]] || log_where=\~/"$remote_dir/$log_dir"
start="cd ~/$remote_dir && mkdir -p $log_dir"
echo "running on every worker of $TPU_NAME: dreamjax $command_name --config $config $*"

if [[ "${DETACH:-0}" == 1 ]]; then
  run "${ssh[@]}" --worker=all "${extra[@]}" --command="$(free_tpu_command 0); $start && \
nohup $job >> $log 2>&1 < /dev/null &"
  echo "started; logs: $log_where/ on the workers; stop it with tpu/tpu_stop.sh"
  exit 0
fi

# The worker count, for one ssh session per worker (gcloud's --worker=all waits for all of them, so it could not stop
# the others when one fails).
workers="${WORKERS:-}"
if [[ -z "$workers" ]]; then
  endpoints=""
  DRY_RUN=1 run gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone="$ZONE" "${extra[@]}" \
    --format='value(networkEndpoints[].ipAddress)'
  if [[ "${DRY_RUN:-0}" != 1 ]]; then
    endpoints="$(gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone="$ZONE" "${extra[@]}" \
      --format='value(networkEndpoints[].ipAddress)')"
  fi
  workers="$(tr ';' '\n' <<< "$endpoints" | grep -c . || true)"
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    echo "(dry run: the worker count is read from that; showing worker 0 only, set WORKERS to show more)"
    workers=1
  elif ((workers == 0)); then
    echo "tpu_run.sh: no workers found for $TPU_NAME in $ZONE" >&2
    exit 1
  fi
fi

stop_all() {  # frees the TPU on every worker, then ends the local ssh sessions still open
  echo "stopping the run on every worker of $TPU_NAME"
  run "${ssh[@]}" --worker=all "${extra[@]}" --command="$(free_tpu_command "$grace")" < /dev/null ||
    echo "tpu_run.sh: stopping the run failed on some worker (one that is gone?)" >&2
  local pid
  for pid in "${pids[@]}"; do
    kill -TERM -- "-$pid" 2> /dev/null || true
  done
}

pids=()
status_dir="$(mktemp -d)"
trap 'rm -rf "$status_dir"' EXIT
trap 'echo "interrupted" >&2; stop_all; exit 130' INT TERM
run "${ssh[@]}" --worker=all "${extra[@]}" --command="$(free_tpu_command 0)"
for ((i = 0; i < workers; i++)); do
  DRY_RUN=1 run "${ssh[@]}" --worker="$i" "${extra[@]}" \
    --command="set -o pipefail && $start && $job 2>&1 | tee -a $log"
  [[ "${DRY_RUN:-0}" == 1 ]] && continue
  set -m  # each session in its own process group: stop_all ends it whole, and Ctrl-C reaches only this script
  (
    rc=0
    "${ssh[@]}" --worker="$i" "${extra[@]}" --command="set -o pipefail && $start && $job 2>&1 | tee -a $log" \
      < /dev/null 2>&1 | while IFS= read -r line || [[ -n "$line" ]]; do echo "[worker $i] $line"; done || rc=$?
    echo "$rc" > "$status_dir/$i.tmp" && mv "$status_dir/$i.tmp" "$status_dir/$i"
  ) &
  pids+=($!)
  set +m
done
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0

# Wait for every worker; on the first failure stop the others.
failed="" rc=0
while :; do
  finished=0
  for ((i = 0; i < workers; i++)); do
    [[ -f "$status_dir/$i" ]] || continue
    finished=$((finished + 1))
    worker_rc="$(cat "$status_dir/$i")"
    if [[ -z "$failed" && "$worker_rc" != 0 ]]; then
      failed="$i" rc="$worker_rc"
    fi
  done
  [[ -n "$failed" || "$finished" == "$workers" ]] && break
  sleep 1
done
if [[ -n "$failed" ]]; then
  why="failed"
  ((rc == PREEMPTED_EXIT)) && why="stopped after saving a checkpoint (preempted?)"
  ((rc == 255)) && why="lost its ssh connection (preempted?)"
  echo "tpu_run.sh: worker $failed $why, exit status $rc; its log: $log_where/ on it" >&2
  stop_all
fi
wait "${pids[@]}" 2> /dev/null || true
exit "$rc"
