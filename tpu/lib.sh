# Shared by the launch scripts in tpu/ (sourced, not run): printing and running commands, checking settings.
# shellcheck shell=bash

# Prints a command as a shell would take it back (arguments quoted only where they need it), then runs it, or with
# DRY_RUN=1 only prints it: every script here can show exactly what it would do.
run() {
  local out="+" arg
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./=:,@%+-]+$ ]]; then
      out+=" $arg"
    else
      out+=" '${arg//\'/\'\\\'\'}'"
    fi
  done
  echo "$out"
  if [[ "${DRY_RUN:-0}" != 1 ]]; then
    "$@"
  fi
}

# `run` in the background: the command is printed at once (so lines keep their order) and its pid appended to the
# caller's `pids` array; nothing starts with DRY_RUN=1.
run_bg() {
  DRY_RUN=1 run "$@"
  if [[ "${DRY_RUN:-0}" != 1 ]]; then
    "$@" &
    pids+=($!)
  fi
}

# Exits with a message naming every listed variable that is unset or empty.
need() {
  local missing=() name
  for name in "$@"; do
    [[ -n "${!name:-}" ]] || missing+=("$name")
  done
  if ((${#missing[@]})); then
    echo "$(basename "$0"): set ${missing[*]} (see $(basename "$0") --help)" >&2
    exit 2
  fi
}

# Prints the script's leading comment block (its usage) when asked for help.
usage() {
  sed -n '2,/^[^#]/{/^#SBATCH/d;/^#/s/^# \{0,1\}//p}' "$0"
}

# The jax version pyproject.toml pins, so accelerator builds always match the CPU one the tests ran with.
jax_version() {
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  sed -n 's/^ *"jax\[cpu\]==\([0-9.]*\)".*/\1/p' "$root/pyproject.toml"
}

# Exits unless CONFIG (FILE or FILE:variant, relative to the checkout) is a file here: a typo should fail before a
# slice's worth of processes start.
check_config() {
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  if [[ ! -f "$root/${1%%:*}" ]]; then
    echo "$(basename "$0"): config ${1%%:*} is not a file in this checkout ($root)" >&2
    exit 2
  fi
}

# The exit status of a dreamjax command stopped by SIGTERM after saving a checkpoint (a preemption notice, or
# tpu/tpu_stop.sh): rerunning the same command resumes from that checkpoint. Change it here only.
# shellcheck disable=SC2034  # used by the scripts that source this file
PREEMPTED_EXIT=75

# A dreamjax process as `ps` shows it: the virtual environment's python running .venv/bin/dreamjax (the shells that
# start it, and the pkill/pgrep below, do not match).
DREAMJAX_PROCESS='^[^ ]*python[0-9.]* [^ ]*[.]venv/bin/dreamjax( |$)'

# The shell command (run on a TPU worker) that frees its TPU: SIGTERM to dreamjax processes and up to $1 seconds for
# them to save a checkpoint and exit (none with 0), then SIGKILL to them and to anything else holding a TPU device
# (/dev/accel* on v4, /dev/vfio/N on v5e, v5p and v6e), then libtpu's lockfile removed, which a killed process leaves
# behind and which makes the next one fail with "TPU in use".
free_tpu_command() {
  local term=""
  if (("$1" > 0)); then
    term="sudo pkill -TERM -f '$DREAMJAX_PROCESS'; for _ in \$(seq $1); do pgrep -f '$DREAMJAX_PROCESS' > /dev/null \
|| break; sleep 1; done; "
  fi
  echo "pgrep -af '$DREAMJAX_PROCESS' | sed 's/^/stopping: /'; ${term}sudo pkill -KILL -f '$DREAMJAX_PROCESS'; \
holders=\$(sudo lsof -t /dev/accel* /dev/vfio/[0-9]* 2> /dev/null); if [ -n \"\$holders\" ]; then echo \"killing \
TPU holders: \$holders\"; sudo kill -9 \$holders; fi; sudo rm -f /tmp/libtpu_lockfile"
}

# Prints the state of $TPU_NAME as `gcloud compute tpus $1 describe --format=$2` gives it, or NOT_FOUND when there
# is none; fails on any other gcloud error. Uses the caller's TPU_NAME, ZONE and extra (gcloud flags: --project) as
# the functions below do.
# shellcheck disable=SC2154
describe_state() {
  local out err rc=0
  err="$(mktemp)"
  out="$(gcloud compute tpus "$1" describe "$TPU_NAME" --zone="$ZONE" "${extra[@]}" --format="$2" 2> "$err")" || rc=$?
  if ((rc)) && grep -q NOT_FOUND "$err"; then
    out=NOT_FOUND rc=0
  elif ((rc)); then
    cat "$err" >&2
  fi
  rm -f "$err"
  echo "$out"
  return "$rc"
}

# The queued resource's state (state.state: WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, SUSPENDING, SUSPENDED,
# FAILED, ...) and the TPU VM's (READY, PREEMPTED, ...), or NOT_FOUND.
queued_state() { describe_state queued-resources 'value(state.state)'; }
node_state() { describe_state tpu-vm 'value(state)'; }

# Polls queued resource $TPU_NAME every WAIT_INTERVAL seconds (default 30), printing each new state, until it is in
# state $1 (ACTIVE, or NOT_FOUND once deleted); fails on SUSPENDING, SUSPENDED or FAILED (naming it) and after
# WAIT_TIMEOUT seconds (default 86400). With DRY_RUN=1 it prints the describe command only.
wait_queued() {
  local want="$1" state last="" start=$SECONDS errors=0
  echo "+ gcloud compute tpus queued-resources describe $TPU_NAME --zone=$ZONE${extra[*]:+ ${extra[*]}}" \
    "--format='value(state.state)'"
  echo "  (every ${WAIT_INTERVAL:-30} s until it is $want, for up to ${WAIT_TIMEOUT:-86400} s)"
  [[ "${DRY_RUN:-0}" == 1 ]] && return 0
  while :; do
    if state="$(queued_state)"; then
      errors=0
    else
      state="(describe failed)"
      if ((++errors >= 3)); then
        echo "$(basename "$0"): describing queued resource $TPU_NAME failed 3 times in a row" >&2
        return 1
      fi
    fi
    [[ "$state" != "$last" ]] && echo "queued resource $TPU_NAME: $state ($((SECONDS - start)) s)"
    last="$state"
    [[ "$state" == "$want" ]] && return 0
    case "$state" in
      SUSPENDING | SUSPENDED | FAILED)
        if [[ "$want" == ACTIVE ]]; then
          echo "$(basename "$0"): queued resource $TPU_NAME is $state, it will not become ACTIVE (details:" \
            "gcloud compute tpus queued-resources describe $TPU_NAME --zone=$ZONE)" >&2
          return 1
        fi ;;
    esac
    if ((SECONDS - start >= ${WAIT_TIMEOUT:-86400})); then
      echo "$(basename "$0"): queued resource $TPU_NAME is still $state after ${WAIT_TIMEOUT:-86400} s" \
        "(waiting for $want)" >&2
      return 1
    fi
    sleep "${WAIT_INTERVAL:-30}"
  done
}
