#!/usr/bin/env bash
# Puts dreamjax on every worker of a TPU slice and installs it with the TPU build of jax (the version pyproject.toml
# pins), Python 3.11 and Java 17 (TextWorld-Express). Rerun it after changing the code: the new files are unpacked
# over the checkout and the virtual environment is kept.
#
# Usage: TPU_NAME=dreamjax ZONE=us-central2-b tpu/tpu_setup.sh
#   TPU_NAME, ZONE, PROJECT, DRY_RUN=1   as for tpu/tpu_create.sh
#   REPO_URL         clone this repository (and BRANCH, default main) on every worker; without it, this checkout's
#                    committed HEAD is copied there (git archive; uncommitted changes are not included)
#   REMOTE_DIR       where the checkout goes on the workers (default: dreamjax, under the login's home)
#   PIP_EXTRA        more pip requirements (default: textworld-express==1.1.0, the env of the TWX configs)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then usage; exit 0; fi
need TPU_NAME ZONE
root="$(cd "$(dirname "$0")/.." && pwd)"
remote_dir="${REMOTE_DIR:-dreamjax}"
extra=()
[[ -n "${PROJECT:-}" ]] && extra+=("--project=$PROJECT")
ssh_all=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all "${extra[@]}")

if [[ -n "${REPO_URL:-}" ]]; then
  echo "cloning $REPO_URL (${BRANCH:-main}) into ~/$remote_dir on every worker"
  run "${ssh_all[@]}" --command="rm -rf ~/$remote_dir.new && git clone --depth 1 --branch ${BRANCH:-main} $REPO_URL \
~/$remote_dir.new && mkdir -p ~/$remote_dir && cp -a ~/$remote_dir.new/. ~/$remote_dir/ && rm -rf ~/$remote_dir.new"
else
  archive="${TMPDIR:-/tmp}/dreamjax-$TPU_NAME.tar.gz"
  echo "copying this checkout's HEAD ($(git -C "$root" rev-parse --short HEAD)) to ~/$remote_dir on every worker"
  run git -C "$root" archive --format=tar.gz -o "$archive" HEAD
  run gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:dreamjax.tar.gz" --zone="$ZONE" --worker=all "${extra[@]}"
  run "${ssh_all[@]}" --command="mkdir -p ~/$remote_dir && tar -xzf ~/dreamjax.tar.gz -C ~/$remote_dir"
fi

version="$(jax_version)"
echo "installing Python 3.11, Java 17 and dreamjax with jax[tpu]==$version on every worker"
run "${ssh_all[@]}" --command="set -euo pipefail && cd ~/$remote_dir && sudo apt-get update -qq && \
sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11 python3.11-venv openjdk-17-jre-headless && \
(test -x .venv/bin/python || python3.11 -m venv .venv) && .venv/bin/pip install -q --upgrade pip && \
.venv/bin/pip install -q -e '.[gcs]' 'jax[tpu]==$version' ${PIP_EXTRA:-textworld-express==1.1.0} && \
.venv/bin/python -c 'import jax; print(jax.__version__, jax.local_devices())'"
