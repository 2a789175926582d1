#!/usr/bin/env bash
# Gathers what benchmarks/gpu/check.sh brings to a GPU machine that has PyTorch,
# Triton and transformers but no package registry (run here, in the repository
# root, with the project's venv):
#   .whl/  the tokenloom wheel without the CPU kernels, and the dependencies
#          that machine lacks (Python 3.12, manylinux x86-64);
#   .gpu/tokenizer/  the default model's tokenizer files.
set -eu
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl .gpu/tokenizer
TOKENLOOM_BUILD_VARIANTS=none "$PY" -m pip wheel -q --no-build-isolation --no-deps -w .whl .
# What tokenloom needs beyond that machine's image, at the versions this venv has.
DEPS="gguf msgspec pyzmq xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types
typing-inspection fastapi starlette uvicorn opentelemetry-api jsonschema
jsonschema-specifications referencing rpds-py xxhash pytest pluggy iniconfig"
PLATFORMS=""
for p in manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux2014; do
    PLATFORMS="$PLATFORMS --platform ${p}_x86_64"
done
for pkg in $DEPS; do
    version=$("$PY" -c "import importlib.metadata as m; print(m.version('$pkg'))")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp $PLATFORMS -d .whl "$pkg==$version"
done
"$PY" - <<'PYEOF'
from transformers import AutoTokenizer

from tokenloom.default_model import default_model_path

gguf = default_model_path()
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(".gpu/tokenizer")
PYEOF
du -sh .whl .gpu
