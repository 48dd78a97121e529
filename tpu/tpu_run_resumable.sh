#!/usr/bin/env bash
# Runs one dreamjax command on a TPU slice held as a queued resource until the command finishes, recreating the
# slice when it is preempted: it runs tpu/tpu_run.sh; when that fails and the queued resource is no longer ACTIVE
# (SUSPENDING, SUSPENDED, FAILED, gone) or the TPU VM is PREEMPTED or TERMINATED, it deletes the queued resource,
# requests it again, waits until it is ACTIVE, sets the new slice up (tpu/tpu_setup.sh, then PREPARE on every worker)
# and runs the same command again, which resumes from the checkpoints in its run folder. A new slice has empty disks,
# so out_dir must be on storage that outlives the slice (a Filestore share that PREPARE mounts; checkpoints may go to
# a bucket, checkpoint_dir=gs://...): a run folder on a worker's disk is lost with it, and the command would start over.
# It starts from whatever it finds: no queued resource (it creates and sets one up), one still waiting for capacity
# (it waits, then sets it up), an ACTIVE one (used as it is: set it up first), a SUSPENDED or FAILED one (recreated).
# Keep it running where it outlives your session (tmux, or nohup ... &); tpu/tpu_stop.sh stops the run (the workers
# save a checkpoint) and then this script, which only recreates a slice that is gone.
#
# Usage: TPU_NAME=dreamjax ZONE=us-central2-b ACCELERATOR=v4-64 PREPARE='...' \
#          tpu/tpu_run_resumable.sh COMMAND CONFIG [--set KEY=VALUE ...]
#   e.g.  tpu/tpu_run_resumable.sh dreamgym configs/scale/dreamgym_llama3b_tpu.py --set out_dir=runs/dreamgym_3b
#   TPU_NAME, ZONE, ACCELERATOR, RUNTIME_VERSION, PROJECT, SPOT=1, WAIT_TIMEOUT, WAIT_INTERVAL, DRY_RUN=1
#                    as for tpu/tpu_create.sh (the slice is always a queued resource, QUEUED=1)
#   REPO_URL, BRANCH, REMOTE_DIR, PIP_EXTRA   as for tpu/tpu_setup.sh: how a new slice gets the code
#   PREPARE          shell command run on every worker of a new slice after set-up, in the checkout (as tpu/tpu_ssh.sh
#                    runs it): mount the shared filesystem that holds runs/, copy the models in
#   MAX_RECREATES    how many times the slice may be recreated before it gives up (default 10)
#   WORKERS, GRACE   as for tpu/tpu_run.sh
# Exit status: 0 when the command finished; otherwise the command's (75, PREEMPTED_EXIT in tpu/lib.sh: it was stopped
# after a checkpoint on a slice that is still up, e.g. by tpu/tpu_stop.sh; rerun this to resume).
set -euo pipefail
here="$(dirname "$0")"
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$here/lib.sh"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
if [[ $# -lt 2 ]]; then usage >&2; exit 2; fi
need TPU_NAME ZONE ACCELERATOR
check_config "$2"
if [[ "${WAIT_TIMEOUT:-86400}" == 0 ]]; then
  echo "tpu_run_resumable.sh: WAIT_TIMEOUT=0 would not wait for the slice; set it to seconds" >&2
  exit 2
fi
export QUEUED=1
extra=()
[[ -n "${PROJECT:-}" ]] && extra+=("--project=$PROJECT")
max="${MAX_RECREATES:-10}"

set_up() {
  "$here/tpu_setup.sh"
  if [[ -n "${PREPARE:-}" ]]; then
    "$here/tpu_ssh.sh" "$PREPARE"
  fi
}

recreate() {
  "$here/tpu_delete.sh" || echo "tpu_run_resumable.sh: deleting failed; waiting for it to be gone anyway" >&2
  wait_queued NOT_FOUND
  "$here/tpu_create.sh"
  set_up
}

# Succeeds (printing why) when the slice is gone or going: three looks, WAIT_INTERVAL seconds apart, since a
# preemption can take a while to show. A failed look counts as healthy: a slice is never deleted on a guess.
slice_lost() {
  local look queued node
  for ((look = 0; look < 3; look++)); do
    ((look)) && sleep "${WAIT_INTERVAL:-30}"
    queued="$(queued_state)" || queued="(describe failed)"
    node="$(node_state)" || node="(describe failed)"
    case "$queued/$node" in
      SUSPENDING/* | SUSPENDED/* | FAILED/* | DELETING/* | NOT_FOUND/* | */PREEMPTED | */TERMINATED | */NOT_FOUND)
        echo "queued resource $queued, TPU VM $node"
        return 0 ;;
    esac
  done
  echo "queued resource $queued, TPU VM $node"
  return 1
}

# The slice as found.
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  echo "+ gcloud compute tpus queued-resources describe $TPU_NAME --zone=$ZONE${extra[*]:+ ${extra[*]}}" \
    "--format='value(state.state)'"
  echo "(dry run: as if it were ACTIVE)"
  state=ACTIVE
else
  state="$(queued_state)"
fi
case "$state" in
  ACTIVE) echo "queued resource $TPU_NAME is ACTIVE: using it as it is" ;;
  NOT_FOUND)
    "$here/tpu_create.sh"
    set_up ;;
  SUSPENDING | SUSPENDED | FAILED | DELETING)
    echo "queued resource $TPU_NAME is $state: recreating it"
    recreate ;;
  *)
    wait_queued ACTIVE
    set_up ;;
esac

recreated=0
while :; do
  rc=0
  "$here/tpu_run.sh" "$@" || rc=$?
  if ((rc == 0)); then
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
      echo "(dry run: were $TPU_NAME preempted, this would follow, up to $max times, then the same command again)"
      recreate
    else
      echo "dreamjax $1 finished on $TPU_NAME (the slice was recreated $recreated times)"
    fi
    exit 0
  fi
  ((rc == 130)) && exit 130  # interrupted
  echo "the run ended with exit status $rc; was $TPU_NAME preempted?"
  if reason="$(slice_lost)"; then
    if ((recreated >= max)); then
      echo "tpu_run_resumable.sh: $TPU_NAME is lost again ($reason) after $max recreations; giving up" >&2
      exit "$rc"
    fi
    recreated=$((recreated + 1))
    echo "$TPU_NAME was preempted ($reason): recreating it ($recreated of at most $max) to resume the run"
    recreate
  elif ((rc == PREEMPTED_EXIT)); then
    echo "tpu_run_resumable.sh: the command stopped after saving a checkpoint, but the slice is up ($reason), so it" \
      "was stopped on purpose (tpu/tpu_stop.sh?): not rerunning it; rerun this to resume" >&2
    exit "$rc"
  else
    echo "tpu_run_resumable.sh: the command failed (exit status $rc) on a slice that is up ($reason): not a" \
      "preemption, so not rerunning it; see the workers' logs" >&2
    exit "$rc"
  fi
done
