dir=$1; shift
if [ "$(id -u)" = 0 ]; then
  if why=$(unshare --mount --propagation slave true 2>&1); then
    # shellcheck disable=SC2016  # the inner script expands its own arguments
    exec unshare --mount --propagation slave sh -c '
      { mount --bind "$1" "$1" && mount -o remount,bind,ro "$1"; } ||
        echo "ddp-deploy: warning: the code snapshot $1 stays writable for root on this node (mount failed)" >&2
      cd "$1" || exit 1; shift; exec "$@"' sh "$dir" "$@"
  fi
  echo "ddp-deploy: warning: the code snapshot $dir stays writable for root on this node (unshare: $why)" >&2
fi
cd "$dir" || exit 1; exec "$@"
