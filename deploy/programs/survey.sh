name=$1; shift
if [ $# -gt 0 ]; then "$@" || exit $?; fi
echo PREPARED
sh -c "$0" sh "$name" || exit $?
ids=$(docker image ls -q --no-trunc) || exit $?
# shellcheck disable=SC2086  # $ids is a list of image ids, split on purpose
[ -z "$ids" ] || docker image inspect --format 'LAYERS {{json .RootFS.Layers}}' $ids 2>/dev/null || true
