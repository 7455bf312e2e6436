#!/usr/bin/env bash
# Here (with PyPI): download the pure-Python packages tests/gpu/check.py needs that the GPU test machine
# lacks, as Python 3.12 wheels, into .gpu_wheels/ (ignored by git; carry it: run(carry=[".gpu_wheels"])).
set -euo pipefail
cd "$(dirname "$0")/../.."
pip download --quiet --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --implementation cp -d .gpu_wheels pydantic
ls .gpu_wheels
