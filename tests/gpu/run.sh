#!/usr/bin/env bash
# On the GPU test machine: install the carried wheels (.gpu_wheels/, from tests/gpu/wheels.sh) beside the
# machine's own packages, then run the check within 8 minutes. Usage: bash tests/gpu/run.sh [check.py args]
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -d .gpu_wheels ]; then
    python3 -m pip install --quiet --no-index --find-links .gpu_wheels --target /tmp/relax_gpu_site pydantic
    # megatron-core without its dependencies (torch, numpy, packaging: the machine's own).
    if ls .gpu_wheels/megatron_core-*.whl > /dev/null 2>&1; then
        python3 -m pip install --quiet --no-index --no-deps --find-links .gpu_wheels --target /tmp/relax_gpu_site \
            megatron-core
    fi
    export PYTHONPATH=/tmp/relax_gpu_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 480 python3 tests/gpu/check.py "$@"
