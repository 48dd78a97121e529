#!/usr/bin/env bash
# System packages the real environments need, installed only where missing (Debian, as root):
# Java 17 for TextWorld-Express and ALFWorld's tooling, Chromium + ChromeDriver for BrowserGym/MiniWoB, strace for
# tests/test_no_network.py (which watches every connect the envs and W&B make).
set -euo pipefail
need=()
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
command -v strace >/dev/null 2>&1 || need+=(strace)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
  echo "install_system_deps: need root to install: ${need[*]} (apt-get install -y ${need[*]})" >&2
  exit 1
fi
SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
echo "installing ${need[*]} with apt-get"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
