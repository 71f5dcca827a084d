#!/usr/bin/env bash
# Install vLLM 0.33.0 into the ACTIVE virtual environment for CPU-side use: its v1 scheduler,
# KV-cache manager and configs, which mambakv.integrations.vllm subclasses and its tests drive
# with fake model outputs (tests/integrations/). Not a GPU install: on a GPU machine install
# vLLM as usual (`pip install 'mambakv[vllm]'` pins the version).
#
#   . .venv/bin/activate && bash scripts/install_vllm_cpu.sh
#
# - vLLM goes in with --no-deps: its full dependency set (a CUDA torch, flashinfer, ...) is
#   neither needed nor installable on CPU. The packages below are the ones its scheduler-side
#   imports and its ModelConfig need (found by importing and adding what was missing); their
#   own dependencies come along. pip prints "vllm requires ..." conflict warnings (torch,
#   transformers, xgrammar pins): expected and harmless for the code the tests import.
# - The 336 MB wheel is downloaded once with `pip download` into $MAMBAKV_WHEEL_CACHE (default
#   ~/.cache/mambakv/wheels) and installed from there afterwards; a second run with vLLM
#   already installed only checks the imports (a few seconds).
# - torch is not touched (the venv's CPU torch, 2.13.0 in CI, stays); pyzmq and msgspec are
#   pinned to the versions the `events` extra resolves to here, so the publisher tests keep
#   the same packages.
set -euo pipefail

VLLM_VERSION=0.33.0
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  echo "install_vllm_cpu.sh: activate the project's virtual environment first (. .venv/bin/activate)" >&2
  exit 2
fi
PY="$VIRTUAL_ENV/bin/python"
CACHE="${MAMBAKV_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mambakv/wheels}"

check_imports() {
  # Run outside the checkout: vLLM warns when imported from inside a git repository.
  (cd / && VLLM_LOGGING_LEVEL=ERROR "$PY" - <<'EOF'
import vllm
assert vllm.__version__ == "0.33.0", vllm.__version__
import vllm.v1.core.kv_cache_manager  # noqa: F401
import vllm.v1.core.sched.async_scheduler  # noqa: F401
import vllm.v1.core.sched.scheduler  # noqa: F401
import vllm.v1.request  # noqa: F401
import vllm.config  # noqa: F401
EOF
  ) 2>/dev/null
}

if check_imports; then
  echo "vllm $VLLM_VERSION already installed in $VIRTUAL_ENV"
  exit 0
fi

mkdir -p "$CACHE"
WHEEL="$(ls "$CACHE"/vllm-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n 1 || true)"
if [[ -z "$WHEEL" ]]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$CACHE" "vllm==$VLLM_VERSION"
  WHEEL="$(ls "$CACHE"/vllm-"$VLLM_VERSION"-*.whl | head -n 1)"
fi

quiet() { grep -v -E "requires|incompatible|dependency resolver|is ignored" || true; }

"$PY" -m pip install -q --no-deps "$WHEEL" 2>&1 | quiet
"$PY" -m pip install -q \
  psutil==7.2.2 \
  pyzmq==27.3.0 \
  msgspec==0.23.0 \
  cbor2==6.3.0 \
  transformers==5.24.0 \
  aiohttp==3.14.5 \
  openai-harmony==0.0.8 \
  openai==3.57.0 \
  pillow==13.0.0 \
  pybase64==1.5.1 \
  cachetools==8.0.2 \
  uvloop==0.23.0 \
  prometheus_client==0.26.0 \
  xgrammar==0.2.9 \
  fastapi==0.165.0 \
  partial-json-parser==0.2.1.1.post7 \
  llguidance==1.9.1 \
  einops==0.8.2 \
  urllib3==2.8.0 \
  requests==2.34.2 \
  cloudpickle==3.1.3 \
  2>&1 | quiet

if ! check_imports; then
  echo "install_vllm_cpu.sh: vllm $VLLM_VERSION installed but its scheduler does not import" >&2
  exit 1
fi
echo "vllm $VLLM_VERSION installed in $VIRTUAL_ENV"
