kill_run() {
  # One grep over the environments of all processes (a grep for each took seconds on a busy node,
  # and the 1 s that launch waits for a job that fails at once went by). The grep runs without the
  # marker: the subshell execs env, which execs grep, so the process it reads as itself is not listed.
  kr_killed=
  for kr_p in $(exec env -u DDP_DEPLOY_RUN grep -lzxF -e "DDP_DEPLOY_RUN=$1" /proc/[0-9]*/environ 2>/dev/null); do
    kr_p=${kr_p#/proc/}; kr_p=${kr_p%/environ}
    [ "$kr_p" = "$2" ] || { kill -KILL "$kr_p" 2>/dev/null; kr_killed="$kr_killed /proc/$kr_p/environ"; }
  done
  # Returns once they are gone (a process being killed still shows its environment for a moment;
  # an ended one, reaped or not, none), or after 5 s.
  kr_i=0
  # shellcheck disable=SC2086  # one word a file
  while [ -n "$kr_killed" ] && [ $kr_i -lt 50 ] && grep -qzxF -e "DDP_DEPLOY_RUN=$1" $kr_killed 2>/dev/null; do
    sleep 0.1; kr_i=$((kr_i + 1))
  done
}
