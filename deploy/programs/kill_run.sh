kill_run() {
  # One grep over the environments of all processes (a grep for each took seconds on a busy node,
  # and the 1 s that launch waits for a job that fails at once went by). The grep runs without the
  # marker: the subshell execs env, which execs grep, so the process it reads as itself is not listed.
  # Any process may set the marker: one is killed only where it also runs as this shell alone, its
  # real, effective, saved and filesystem uids all this shell uid (the user who started the run, and
  # who stops it): the process of another user is never killed, whatever its environment holds, by
  # root either. Its ancestry cannot tell more here: what is left to kill are the workers torchrun
  # started in sessions of their own, once their launcher has ended and init has them.
  kr_killed=
  kr_me=$(id -u)
  for kr_p in $(exec env -u DDP_DEPLOY_RUN grep -lzxF -e "DDP_DEPLOY_RUN=$1" /proc/[0-9]*/environ 2>/dev/null); do
    kr_p=${kr_p#/proc/}; kr_p=${kr_p%/environ}
    [ "$kr_p" = "$2" ] && continue
    [ "$(awk "/^Uid:/ { print \$2, \$3, \$4, \$5; exit }" "/proc/$kr_p/status" 2>/dev/null)" = "$kr_me $kr_me $kr_me $kr_me" ] ||
      continue
    kill -KILL "$kr_p" 2>/dev/null; kr_killed="$kr_killed /proc/$kr_p/environ"
  done
  # Returns once they are gone (a process being killed still shows its environment for a moment;
  # an ended one, reaped or not, none), or after 5 s.
  kr_i=0
  # shellcheck disable=SC2086  # one word a file
  while [ -n "$kr_killed" ] && [ $kr_i -lt 50 ] && grep -qzxF -e "DDP_DEPLOY_RUN=$1" $kr_killed 2>/dev/null; do
    sleep 0.1; kr_i=$((kr_i + 1))
  done
}
