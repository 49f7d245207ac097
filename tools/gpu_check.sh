#!/usr/bin/env bash
# The CUDA path in one run on a lent GPU: installs the kit (`make gpu-kit`, carried as
# .gpukit/part*) offline into a folder of its own, runs the GPU tests and the benches on the
# GPU, and writes summary.json and logs.tar.gz to $OUT (tools/gpu_check.py says what each step
# does). GPU_CHECK_DEVICE=cpu rehearses the same steps on CPU; GPU_CHECK_PYTHON picks the
# Python (python3 by default: on the GPU machines, the one that holds the CUDA torch).
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${GPU_CHECK_PYTHON:-python3}" tools/gpu_check.py "$@"
