# Shared by bench/carry_ray.sh and bench/carry_model.sh (source it): a file too large for one device call's
# 64 MiB working tree is split into parts under distinct ignored folders, carried one per call to the same warm
# machine (a carried ignored file stays there until the machine goes back), then joined and checked there.

# split_parts DIR FILE STEM PART_MB: DIR/part-00/STEM.part-00, ... each with NAME and SHA256 of FILE beside it;
# prints the parts' sizes. Removes FILE.
split_parts() {
    local dir=$1 file=$2 stem=$3 mb=$4
    basename "$file" > "$dir/NAME"
    (cd "$(dirname "$file")" && sha256sum "$(basename "$file")") > "$dir/SHA256"
    split -b "${mb}M" -d -a 2 "$file" "$dir/$stem.part-"
    rm -f "$file"
    local k=0
    for p in "$dir/$stem".part-*; do
        mkdir -p "$dir/part-$(printf %02d $k)"
        mv "$p" "$dir/part-$(printf %02d $k)/"
        cp "$dir/NAME" "$dir/SHA256" "$dir/part-$(printf %02d $k)/"
        k=$((k + 1))
    done
    du -sh "$dir"/part-*
}

# join_parts DIR STEM: joins the carried parts into /tmp/<original name>, checks its sha256, prints the path.
join_parts() {
    local dir=$1 stem=$2
    [ -d "$dir/part-00" ] || { echo "$dir/part-00 missing: carry the parts first" >&2; return 1; }
    local name; name=$(cat "$dir"/part-00/NAME)
    cat "$dir"/part-*/"$stem".part-* > "/tmp/$name"
    (cd /tmp && sha256sum --quiet -c "$OLDPWD/$dir/part-00/SHA256" >&2) \
        || { echo "$name: parts missing or corrupt (carry every part on this warm machine)" >&2; return 1; }
    echo "/tmp/$name"
}
