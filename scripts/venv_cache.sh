# Sourced by setup.sh, colab_env.sh and torch_floor_env.sh when .ci/run asks for cached venvs
# (GPTLIB_VENV_CACHE=1). Installing the same packages into a fresh venv on every CI run took most of the
# set-up time (main ~2 min, most of it pip fetching PyPI's pages; floor ~2.5 min; Colab ~1.3 min for 4.6 GB),
# so each venv is built once per key into a cache folder outside the repo and every run hard-links a copy of it
# (seconds, no extra disk) and checks it. gptlib itself is never in the cache: each run installs it from the
# clone into its copy.
#
#   venv_from_cache PYTHON DEST CACHE KEY BUILD_FUNCTION
#
# KEY names what the venv holds (a hash of the pins or requirements, the Python, and for unpinned envs the week,
# so they take new releases weekly as a fresh install would). BUILD_FUNCTION is called with $VPY set to the new
# venv's python and installs into it. The copy is checked: its `pip freeze --all` must equal the one recorded when
# the cache was built (a package added, removed or changed since fails the run).

_venv_fix_paths() {
    # A venv's console scripts name its python in their first line: repoint the copy's at the copy's python.
    # sed -i writes a new file, so the cached one behind the hard link is untouched.
    local dest_abs="$1" f
    for f in "$dest_abs"/bin/*; do
        [ -f "$f" ] && [ ! -L "$f" ] || continue
        head -c 2 "$f" | grep -q '#!' || continue
        head -1 "$f" | grep -q '/bin/python' || continue
        sed -i "1s|^#!.*/bin/python[0-9.]*\$|#!$dest_abs/bin/python|" "$f"
    done
    # bin/activate* name the folder the venv was built in (building-PID, gone since): `. .venv/bin/activate`
    # (scripts/phase1.sh) would put a missing folder first on PATH and run another python
    for f in "$dest_abs"/bin/activate*; do
        [ -f "$f" ] || continue
        sed -i -E "s|[^\"' ]*/building-[0-9]+|$dest_abs|g" "$f"
    done
}

venv_from_cache() {
    local py="$1" dest="$2" cache="$3" key="$4" build="$5"
    local dir="$cache/venv-$key"
    mkdir -p "$cache"
    rm -rf "$dest"
    (
        flock 9  # one build per cache at a time; no other run deletes an old key while this one copies it
        if [ ! -f "$dir/freeze.txt" ]; then
            echo "building the cached venv $dir (once per key)"
            local tmp="$cache/building-$$"
            rm -rf "$tmp"
            "$py" -m venv "$tmp"
            VPY="$tmp/bin/python" "$build"
            "$tmp/bin/python" -m pip freeze --all | sort > "$tmp/freeze.txt"
            find "$cache" -maxdepth 1 -name 'venv-*' ! -name "venv-$key" -exec rm -rf {} +
            mv "$tmp" "$dir"
        fi
        cp -al "$dir" "$dest" 2>/dev/null || cp -a "$dir" "$dest"  # another filesystem: a full copy
    ) 9>"$cache/venv.lock"
    local dest_abs
    dest_abs="$(cd "$dest" && pwd)"
    _venv_fix_paths "$dest_abs"
    "$dest/bin/python" -m pip freeze --all | sort > "$dest/freeze-copy.txt"
    if ! diff -u "$dest/freeze.txt" "$dest/freeze-copy.txt"; then
        echo "FAIL: the venv copied from $dir does not hold what was installed into it (diff above)"; return 1
    fi
}

# A key from files' contents and strings: venv_key FILE_OR_STRING...
venv_key() {
    local a
    for a in "$@"; do if [ -f "$a" ]; then cat "$a"; else echo "$a"; fi; done | sha256sum | cut -c1-16
}
