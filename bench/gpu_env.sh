# Source on the device machine (its image lacks craftax & co.): installs the carried wheels from .whl/
# (made by ../shared/scripts/gpu-wheels.sh) and sets the paths the benchmarks expect.
#   source bench/gpu_env.sh && python bench/ppo_hidden_sps.py ...
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src THINKCRAFT_CACHE=$PWD/.ref/tc-cache XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
