#!/usr/bin/env bash
# Runs one dreamjax command on several GPU hosts at once over plain ssh, one JAX process per host driving all of its
# GPUs. Each process gets the three variables dreamjax.parallel.distributed reads off a cluster JAX cannot detect:
# JAX_COORDINATOR_ADDRESS (process 0's host:port), JAX_NUM_PROCESSES (the host count), JAX_PROCESS_ID (the host's
# index in HOSTS). Waits for every host and fails if any does; logs go to logs/COMMAND-<process id>.log on each.
#
# Usage: HOSTS=gpu-a,gpu-b tpu/gpu_ssh_run.sh COMMAND CONFIG [--set KEY=VALUE ...]
#   e.g.  HOSTS=gpu-a,gpu-b tpu/gpu_ssh_run.sh dreamgym configs/scale/dreamgym_llama8b_gpu.py
#   HOSTS            comma-separated ssh host names, process 0 first (required)
#   COORDINATOR      host:port of process 0's coordinator, as the other hosts reach it (default: first host:12355)
#   REMOTE_DIR       the checkout on every host (default: dreamjax)
#   MEM_FRACTION     share of each GPU's memory XLA may take (default 0.9; JAX's own default is 0.75)
#   DRY_RUN=1        print the ssh commands instead of running them
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
if [[ $# -lt 2 ]]; then usage >&2; exit 2; fi
need HOSTS
command_name="$1" config="$2"
shift 2
check_config "$config"
IFS=, read -r -a host_list <<< "$HOSTS"
coordinator="${COORDINATOR:-${host_list[0]}:12355}"
remote_dir="${REMOTE_DIR:-dreamjax}"
args=""
for arg in "$@"; do
  args+=" $(printf '%q' "$arg")"
done

echo "running dreamjax $command_name --config $config$args on ${#host_list[@]} hosts (coordinator $coordinator)"
pids=()
for i in "${!host_list[@]}"; do
  run_bg ssh "${host_list[$i]}" "cd ~/$remote_dir && mkdir -p logs && JAX_COORDINATOR_ADDRESS=$coordinator \
JAX_NUM_PROCESSES=${#host_list[@]} JAX_PROCESS_ID=$i XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.9} \
.venv/bin/dreamjax $command_name --config $config$args > logs/$command_name-$i.log 2>&1"
done
failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "process $i on ${host_list[$i]} failed: see ~/$remote_dir/logs/$command_name-$i.log there" >&2
    failed=1
  fi
done
exit "$failed"
