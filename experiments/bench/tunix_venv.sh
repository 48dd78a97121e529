#!/usr/bin/env bash
# Creates the separate venv that runs google-tunix, the JAX peer of the sampler and GRPO benchmarks.
#
# tunix 0.1.7 cannot share dreamjax's venv: it caps safetensors<0.8 and brings its own stack (qwix, metrax, grain, ...).
# jax and flax are pinned to the versions in dreamjax's venv so both contenders compile with the same XLA; torch (the
# local CPU wheel; any other torch spec pulls GBs of CUDA packages) and transformers let tunix_peer.py check tunix's
# logits against transformers' on the same HF folder before it times anything.
#
# Usage: bash experiments/bench/tunix_venv.sh   (idempotent: does nothing when the venv already imports tunix)
# Env:   TUNIX_VENV (default <repo>/.venv-tunix), PYTHON (default python3.11)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${TUNIX_VENV:-$ROOT/.venv-tunix}"
PYTHON="${PYTHON:-python3.11}"
PACKAGES=(google-tunix==0.1.7 "jax[cpu]==0.10.2" flax==0.12.8 optax==0.2.8 transformers==5.12.1 torch==2.13.0)

check() {
  "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import tunix.generate.sampler, tunix.models.qwen2.params, tunix.rl.grpo.grpo_learner, torch, transformers  # noqa: F401
print("tunix", md.version("google-tunix"), "jax", md.version("jax"), "flax", md.version("flax"),
      "transformers", transformers.__version__, "torch", torch.__version__)
EOF
}

if [[ -x "$VENV/bin/python" ]] && check >/dev/null 2>&1; then
  echo "tunix venv already installed at $VENV: $(check 2>/dev/null | tail -1)"
  exit 0
fi

command -v "$PYTHON" >/dev/null || { echo "tunix_venv.sh: $PYTHON not found (tunix needs Python >= 3.11)" >&2; exit 1; }
echo "creating $VENV with $("$PYTHON" --version)"
"$PYTHON" -m venv "$VENV"
# This machine's pip config lists local index folders that may be absent; pip warns once per package about them.
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
quiet "$VENV/bin/pip" install -q --upgrade pip
quiet "$VENV/bin/pip" install -q "${PACKAGES[@]}"
"$VENV/bin/pip" check || echo "tunix_venv.sh: pip check reports conflicts (above); the import check below decides" >&2
echo "installed: $(check | tail -1)"
