#!/usr/bin/env bash
# Here (with PyPI): download what tests/gpu/check.py needs that the GPU test machine lacks, as Python 3.12
# wheels, into .gpu_wheels/ (ignored by git; carry it: run(carry=[".gpu_wheels"]), 64 MiB at most):
#   pydantic (and its dependencies)   pure Python but for pydantic-core
#   megatron-core                     the megatron check; only the wheel (--no-deps): it needs torch,
#                                     numpy and packaging, which the machine has (run.sh installs it so)
set -euo pipefail
cd "$(dirname "$0")/../.."
MEGATRON_CORE_VERSION=0.16.1  # as docker/Dockerfile installs
pip download --quiet --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --implementation cp -d .gpu_wheels pydantic
# megatron-core's wheel is tagged manylinux_2_24/2_28 (a small C++ extension for its datasets).
pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    --implementation cp -d .gpu_wheels "megatron-core==${MEGATRON_CORE_VERSION}"
ls -l .gpu_wheels
du -sh .gpu_wheels
