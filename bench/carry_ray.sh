#!/usr/bin/env bash
# Carry Ray to the GPU machine, whose image has none and which reaches no registry. Its wheel (~76 MB) is over
# one device call's 64 MiB working tree, so it travels in parts, on consecutive calls to the same warm machine,
# under distinct ignored paths (ignored files that a call carried stay there until the machine goes back), and
# is joined and installed there.
#
#   1. here, once:             bench/carry_ray.sh prepare
#        downloads ray (the version installed here) and its pure-Python needs for the device's Python 3.12,
#        splits the wheel into .ray-whl/part-00, part-01, ... (PART_MB each, default 50: a part plus the
#        ~12 MB tracked tree stays under 64 MiB) and writes .ray-whl/SHA256; prints the calls to make.
#   2. one device call per part, same kind, while the machine stays warm (command `true` is enough):
#        carry [".ray-whl/part-00"], then [".ray-whl/part-01", ".ray-whl/deps"], ...
#   3. in the call that uses Ray (no need to carry the parts again):
#        source bench/carry_ray.sh install && python -m pytest -q tests/test_pools_ray.py ...
#      joins the parts, checks the sha256, installs into /tmp/site and puts it on PYTHONPATH.
[[ "${BASH_SOURCE[0]}" == "$0" ]] && set -euo pipefail  # not when sourced: it would stay in the caller's shell
DIR=.ray-whl
PART_MB=${PART_MB:-50}
PY=${PY:-/work/main/.venv/bin/python}
source "$(dirname "${BASH_SOURCE[0]}")/carry_lib.sh"
DEPS="click jsonschema jsonschema-specifications referencing rpds-py attrs msgpack protobuf pyyaml filelock packaging
requests urllib3 idna charset-normalizer certifi"

version() {  # the version installed here (the one the tests ran with)
    "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"
}

prepare() {
    git check-ignore -q "$DIR/x" || { echo "$DIR/ must be git-ignored (it is in .gitignore)"; exit 1; }
    rm -rf "$DIR" && mkdir -p "$DIR/deps" "$DIR/full"
    local plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    plat="$plat --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 --platform any"
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
        -d "$DIR/full" "ray==$(version ray)"
    for d in $DEPS; do
        # shellcheck disable=SC2086
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
            -d "$DIR/deps" "$d==$(version "$d")" 2>/dev/null \
        || "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
            -d "$DIR/deps" "$d"
    done
    split_parts "$DIR" "$(ls "$DIR"/full/ray-*.whl)" ray.whl "$PART_MB"
    rm -rf "$DIR/full"
    local k; k=$(ls -d "$DIR"/part-* | wc -l)
    du -sh "$DIR/deps"
    echo "device calls, in order, on one warm machine (command: true):"
    local last=$((k - 1))
    for i in $(seq 0 $last); do
        if [ "$i" = "$last" ]; then
            echo "  carry [\"$DIR/part-$(printf %02d "$i")\", \"$DIR/deps\"]"
        else
            echo "  carry [\"$DIR/part-$(printf %02d "$i")\"]"
        fi
    done
    echo "then: source bench/carry_ray.sh install && <the command that uses Ray>"
}

install() {
    local whl; whl=$(join_parts "$DIR" ray.whl) || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$whl" "$DIR"/deps/*.whl
    export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/site/bin:$PATH
    python3 -c "import ray; print('ray', ray.__version__, 'from', ray.__file__)"
}

case "${1:-}" in
    prepare) prepare ;;
    install) install ;;
    *) echo "usage: bench/carry_ray.sh prepare | source bench/carry_ray.sh install" >&2 ;;
esac
