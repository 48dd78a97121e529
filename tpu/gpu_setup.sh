#!/usr/bin/env bash
# Puts dreamjax on every GPU host and installs it with the CUDA 12 build of jax (the version pyproject.toml pins).
# Hosts need ssh access from here, Python 3.11 and Java 17 (TextWorld-Express); on a shared filesystem one host is
# enough (HOSTS=that one).
#
# Usage: HOSTS=gpu-a,gpu-b tpu/gpu_setup.sh
#   HOSTS            comma-separated ssh host names (required)
#   REPO_URL         clone this repository (and BRANCH, default main) on every host; without it, this checkout's
#                    committed HEAD is copied there (git archive; uncommitted changes are not included)
#   REMOTE_DIR       where the checkout goes (default: dreamjax, under the login's home)
#   PYTHON           the interpreter the virtual environment is made with (default: python3.11)
#   PIP_EXTRA        more pip requirements (default: textworld-express==1.1.0, the env of the TWX configs)
#   DRY_RUN=1        print the ssh/scp commands instead of running them
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
need HOSTS
root="$(cd "$(dirname "$0")/.." && pwd)"
remote_dir="${REMOTE_DIR:-dreamjax}"
version="$(jax_version)"
IFS=, read -r -a host_list <<< "$HOSTS"
archive="${TMPDIR:-/tmp}/dreamjax-gpu.tar.gz"
if [[ -z "${REPO_URL:-}" ]]; then
  run git -C "$root" archive --format=tar.gz -o "$archive" HEAD
fi

for host in "${host_list[@]}"; do
  if [[ -n "${REPO_URL:-}" ]]; then
    echo "$host: cloning $REPO_URL (${BRANCH:-main}) into ~/$remote_dir"
    run ssh "$host" "rm -rf ~/$remote_dir.new && git clone --depth 1 --branch ${BRANCH:-main} $REPO_URL \
~/$remote_dir.new && mkdir -p ~/$remote_dir && cp -a ~/$remote_dir.new/. ~/$remote_dir/ && rm -rf ~/$remote_dir.new"
  else
    echo "$host: copying this checkout's HEAD to ~/$remote_dir"
    run scp "$archive" "$host:dreamjax.tar.gz"
    run ssh "$host" "mkdir -p ~/$remote_dir && tar -xzf ~/dreamjax.tar.gz -C ~/$remote_dir"
  fi
  echo "$host: installing dreamjax with jax[cuda12]==$version"
  run ssh "$host" "set -euo pipefail && cd ~/$remote_dir && (test -x .venv/bin/python || ${PYTHON:-python3.11} -m venv \
.venv) && .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e '.[gcs]' 'jax[cuda12]==$version' \
${PIP_EXTRA:-textworld-express==1.1.0} && .venv/bin/python -c 'import jax; print(jax.__version__, jax.local_devices())'"
done
