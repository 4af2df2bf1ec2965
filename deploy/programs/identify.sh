store=$(docker_store) || exit $?
echo "STORE $store"
id=$(docker image inspect --format '{{.Id}}' "$1" 2>/dev/null) || id=-
echo "ID $id"
ids=$(docker image ls -q --no-trunc) || exit $?
# shellcheck disable=SC2086  # $ids is a list of image ids, split on purpose
if printf '%s\n' $ids | grep -qxF -- "$id"; then echo "LISTED yes"; else echo "LISTED no"; fi
