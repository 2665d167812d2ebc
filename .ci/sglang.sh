#!/usr/bin/env bash
# SGLang's own HiCache pool classes moving KV through kvtier, on CPU
# (tests/adapters/test_sglang_package.py, after kvtier.adapters.sglang_install.install()),
# and kvtier's HiCache L3 backend (kvtier.store.sglang) under SGLang's own backend factory
# and cache controllers (tests/store/test_sglang_storage.py: the file store, and the Redis
# node of KVTIER_TEST_REDIS_URL or one it starts).
#
# sglang==0.5.23 is installed WITHOUT its dependency tree (torch, CUDA kernels, servers):
# `pip install --no-deps` of it and of the light packages its pool modules import, into a
# target directory that is put on PYTHONPATH for this one pytest run, beside the main .venv
# (its torch is reused). Idempotent: the directory is kept in .sglang-target (git-ignored)
# and reused while its marker matches the pins below; KVTIER_SGLANG_TARGET moves it.
# Where the pins cannot be installed (no network, another Python than SGLang's wheel's),
# one line says so and the script exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${KVTIER_PYTHON:-.venv/bin/python}
TARGET=${KVTIER_SGLANG_TARGET:-.sglang-target}
# sglang's own pins where it has them (transformers, tokenizers, sentencepiece,
# compressed-tensors, apache-tvm-ffi), else the versions tested.
PINS=(sglang==0.5.23 transformers==5.19.0 tokenizers==0.23.2 safetensors==0.8.0
      huggingface_hub==2.4.0 sentencepiece==0.2.1 compressed-tensors==0.18.0
      apache-tvm-ffi==0.1.11 gguf==0.19.0 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1
      msgspec==0.23.0 pyzmq==27.3.0 pydantic==2.14.4 pydantic_core==2.50.5
      annotated_types==0.8.0 typing_inspection==0.4.5 starlette==1.10.0 anyio==4.16.0
      aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0
      frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 requests==2.34.2
      urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 httpx2==2.16.2
      httpcore2==2.16.2 h11==0.16.0 truststore==0.10.5 regex==2026.11.19 pyyaml==6.0.4
      tqdm==4.70.1 ipython==9.18.1 traitlets==5.16.1 dill==0.4.1 loguru==0.7.3)

if [ ! -x "$PY" ]; then
  echo "sglang: skipped: $PY not found (bash tests/run.sh builds it)"; exit 0
fi
# shellcheck source=.ci/pinned_target.sh
source .ci/pinned_target.sh
pinned_target sglang "$PY" "$TARGET" "${PINS[@]}" || exit 0
echo "sglang: SGLang's pools on kvtier, kvtier's L3 backend in SGLang (tests/adapters/test_sglang_package.py, tests/store/test_sglang_storage.py)"
PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -p no:cacheprovider \
  -W ignore::DeprecationWarning -W ignore::UserWarning tests/adapters/test_sglang_package.py \
  tests/store/test_sglang_storage.py "$@"
