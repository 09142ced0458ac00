#!/usr/bin/env bash
# End a device call with `bash bench/pack_out.sh`: the device tool brings back at most 8 files from $OUT
# (/work/.library/device/README.md), and a profiled run alone writes three a case (2026-11-29: a decode probe's
# profiles did not come back, "files_left_out ... (count)"). Packs every file under $OUT into one $OUT/out.tgz
# (unpack here: tar xzf <files_at>/out.tgz -C bench/results/logs), keeping NAMES (default: none) beside it.
set -euo pipefail
: "${OUT:?bench/pack_out.sh runs on the device machine, where OUT is set}"
cd "$OUT"
files=$(find . -type f ! -name out.tgz | sed 's|^\./||' | sort)
[ -n "$files" ] || { echo "pack_out: nothing under $OUT"; exit 0; }
# shellcheck disable=SC2086
tar czf out.tgz $files
keep=" ${NAMES:-} "
for f in $files; do
  case "$keep" in *" $f "*) ;; *) rm -f "$f" ;; esac
done
find . -mindepth 1 -type d -empty -delete
echo "pack_out: $(echo "$files" | wc -l) files in $OUT/out.tgz ($(du -h out.tgz | cut -f1))"
