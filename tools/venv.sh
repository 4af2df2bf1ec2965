#!/usr/bin/env bash
# tools/venv.sh DIR PINS...: a venv at DIR with PINS (torch's pins), this package's dependencies
# and its test tools, and this package installed editable (the Makefile's `install` and
# `install-base`, `install-oldest`).
#
# Everything but this package comes from a venv kept under $DDP_VENV_CACHE (default
# /var/cache/ddp-bundle/venvs), named by a hash of what decides its contents: the interpreter, the
# pins, pyproject.toml, this script, and the ISO week, so that the dependencies pyproject.toml does
# not pin are resolved afresh each week, as a user's install would find them. A clone on a machine
# that already built that venv (CI's machine keeps what an earlier run left) gets a hard-linked copy
# of it, its scripts pointed at DIR, instead of unpacking torch again (about 1.5 min of the 2 cores).
# DDP_VENV_CACHE= (empty) builds DIR directly, as `pip install` alone would.
# tools/venv.sh --kept PINS... prints where the kept venv for PINS is (or would be); --prune removes
# the kept venvs but the newest three, as each build does once it is done.
#
# The copy shares the kept venv's files, not its directories: pip and Python replace a file rather
# than write into it (a script's new first line here, a .pyc), so the kept venv is never changed
# through DIR. Where DIR is on another filesystem than the cache, the files are copied.
set -euo pipefail

DIR=$1
shift
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")/.." && pwd)

build() {  # build VENV: the venv, its pins, the package's dependencies and test tools
    "$PYTHON" -m venv "$1"
    "$1/bin/pip" install -q --upgrade pip
    "$1/bin/pip" install -q "${@:2}"
    # (flock: the venvs are made side by side, `make -j`, and each editable install writes this
    # package's egg-info in the source tree.)
    (cd "$HERE" && flock .editable-install.lock "$1/bin/pip" install -q -e '.[dev]')
}

CACHE=${DDP_VENV_CACHE-/var/cache/ddp-bundle/venvs}
if [ -z "$CACHE" ]; then
    rm -rf "$DIR"
    build "$DIR" "$@"
    touch "$DIR/.installed"
    exit 0
fi

prune() {
    # Kept venvs of other inputs (an earlier week's, other pins), a few GB each: the newest three (the
    # three torch points the Makefile tests; a venv's time is its last use) stay, the others go unless
    # a copy is being taken of them.
    find "$CACHE" -mindepth 1 -maxdepth 1 -type d -printf '%T@ %p\n' | sort -rn | tail -n +4 | cut -d' ' -f2- \
        | while read -r old; do flock -n -x "$old.lock" rm -rf "$old" || true; done
}
if [ "$DIR" = --prune ]; then
    prune
    exit 0
fi

key=$({ "$PYTHON" -VV; printf '%s\n' "$@"; cat "$HERE/pyproject.toml" "$0"; date -u +%G-W%V; } | sha256sum | cut -c1-16)
kept=$CACHE/$key
if [ "$DIR" = --kept ]; then
    echo "$kept"
    exit 0
fi
mkdir -p "$CACHE"
(
    # One builder per kept venv; the others (the Makefile's -j) wait for it and take its copy.
    flock 9
    if [ ! -e "$kept/.complete" ]; then
        rm -rf "$kept"
        build "$kept" "$@"
        "$kept/bin/pip" uninstall -q -y ddp-bundle  # the package itself is each clone's own
        touch "$kept/.complete"
        prune
    fi
) 9>"$kept.lock"

rm -rf "$DIR"
(
    flock -s 9  # no builder removes it while it is copied
    touch "$kept"  # its time is its last use: what the builders' clean-up keeps the newest of
    cp -al "$kept" "$DIR" 2>/dev/null || { rm -rf "$DIR"; cp -a "$kept" "$DIR"; }
) 9>"$kept.lock"
rm -f "$DIR/.complete"
echo "$kept" > "$DIR/.kept"  # which kept venv it is a copy of (the key holds the week it was made in)
target=$(cd "$DIR" && pwd)
# Each script's first line, the activation scripts and pyvenv.cfg name the venv by its path.
grep -lIs -- "$kept" "$DIR"/bin/* "$DIR/pyvenv.cfg" | while read -r f; do
    sed -i "s|$kept|$target|g" "$f"
done
(cd "$HERE" && flock .editable-install.lock "$DIR/bin/pip" install -q --no-deps -e .)
if ! broken=$("$DIR/bin/pip" check); then
    echo "$broken" >&2
    exit 1
fi
touch "$DIR/.installed"
