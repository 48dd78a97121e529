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
