kill_run() {
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" = "$2" ] || ! grep -qzxF -e "DDP_DEPLOY_RUN=$1" "$p/environ" 2>/dev/null || kill -KILL "${p#/proc/}" 2>/dev/null
  done
}
