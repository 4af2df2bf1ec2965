# The job's workers on a node and their stacks (doctor runs it through the job's runtime, the launcher's watch on a stall):
# $1 = the job's heartbeat dir, $2 = py-spy (a path, else the name on PATH). Every worker of the job
# on this node, found by what the kernel says of it, as _marked does: it runs with the job's uid
# alone (real, effective, saved and filesystem: this script's, or as root, `docker exec -u 0` in the
# job's container, that of this pid namespace's first process, the container's launcher; a node's is
# init, root), and it descends from the launcher named in $1/launcher ("PID START", while it is that
# process) or from what runs this script (the launcher's own watchdog). Among those: its environment
# holds DDP_HEARTBEAT_DIR=$1 and LOCAL_RANK (torchrun's workers; the launcher and torchrun have
# none); or, forked by the launcher's zygote (agent/zygote.py), whose environment is the
# launcher's, it is named in $1/workers/LOCAL_RANK and its environment holds DDP_HEARTBEAT_DIR=$1.
# Any process may set that environment: it narrows the search, it proves nothing.
# Per worker: "rank PID RANK LOCAL_RANK STATE" (STATE: /proc's letter, T when stopped; read again
# for up to 3 s while another tracer holds the worker, t), then, unless it is stopped (py-spy
# would wait on it), "stack PID JSON", py-spy's dump of its threads on one line (or its error;
# asked again for up to 3 s while another tracer holds the worker). Then "workers N". Last, where
# the workers keep torch's flight recorder (trainer/flight.py: a file fr-LOCAL_RANK in $1 says so), "fr PID SEQ OP" for each one that answered
# this request, or one made in the second before it or since, within 2 s: the newest collective it is in or did. The job's own values are printed
# only as digits, lowercase names or py-spy's JSON.
marker="DDP_HEARTBEAT_DIR=$1"; spy=$2; found=0; ask=""; fr=""; since=0
[ -x "$spy" ] || spy=py-spy
fresh() {  # TOKEN: a request made at most a second before this one, or later (its first word, digits of the same length)
  t=${1%%-*}
  case $t in ''|*[!0-9]*) return 1 ;; esac
  [ ${#t} -eq ${#since} ] && [ "$t" -ge "$since" ] 2>/dev/null
}
if [ -d "$1" ] && [ ! -L "$1" ] && ls "$1"/fr-[0-9]* > /dev/null 2>&1; then
  # the directory is the job's: a new file (noclobber: O_EXCL), never through a link it put there
  # A diagnosis beside this one (status's, the launcher's watch, doctor) may ask at the same moment:
  # the workers answer the newest request only, and any answer to a request made since this one
  # asked serves both. A token is "NANOSECONDS-PID".
  now=$(date +%s%N); ask="$now-$$"; rm -f "$1/fr-request"
  # Another asker's request of about now stands whichever of the two wrote last (its own may be
  # the older, written after this one removed it): an answer to a request made in the second
  # before this one serves (a stall is far longer)
  since=$((now - 1000000000))
  (set -C; echo "$ask" > "$1/fr-request") 2>/dev/null || :
fi
seen=" "
worker() {  # PID RANK LOCAL_RANK
  tries=0
  while :; do
    state=$(sed -n 's/^State:[[:space:]]*\([A-Za-z]\).*/\1/p' "/proc/$1/status" 2>/dev/null)
    # t: another tracer holds it for a moment (a diagnosis beside this one): its own state after
    if [ "$state" != t ] || [ $tries -ge 30 ]; then break; fi
    tries=$((tries + 1)); sleep 0.1
  done
  found=$((found + 1)); seen="$seen$1 "
  echo "rank $1 ${2:-?} $3 ${state:-?}"
  [ -f "$dir/fr-$3" ] && fr="$fr $1:$3"
  [ "$state" = T ] && return
  tries=0
  while :; do
    dump=$(timeout 20 "$spy" dump --pid "$1" --json 2>&1 | tr '\n' ' ')
    # another tracer holds it for a moment (a diagnosis beside this one: the launcher's on a stall,
    # an operator's doctor or status): it may be suspended by one at a time
    case $dump in *"Failed to suspend process"*) ;; *) break ;; esac
    tries=$((tries + 1)); [ $tries -lt 15 ] || break; sleep 0.2
  done
  echo "stack $1 $dump"
}
dir=$1
uid_of() {  # PID: its uid, where its real, effective, saved and filesystem uids are one
  awk '/^Uid:/ { if ($2 == $3 && $2 == $4 && $2 == $5) print $2; exit }' "/proc/$1/status" 2>/dev/null
}
uid=$(id -u); [ "$uid" = 0 ] && uid=$(uid_of 1)
roots=" "; [ "$PPID" -gt 0 ] && roots=" $PPID "
if [ -f "$1/launcher" ] && [ ! -L "$1/launcher" ] && read -r lpid lstart _ 2>/dev/null < "$1/launcher"; then
  case "$lpid.$lstart" in
    *[!0-9.]*|.*|*.) ;;
    *) if [ "$(awk '{ sub(/.*\) /, ""); print $20 }' "/proc/$lpid/stat" 2>/dev/null)" = "$lstart" ] &&
          [ "$(uid_of "$lpid")" = "$uid" ]; then roots="$roots$lpid "; fi ;;
  esac
fi
ours() {  # PID: it runs with the job's uid, and one of $roots is in its chain of parents (/proc/PID/stat)
  [ -n "$uid" ] && [ "$(uid_of "$1")" = "$uid" ] || return 1
  awk -v p="$1" -v roots="$roots" 'BEGIN {
    for (n = 0; n < 4096 && p > 0; n++) {
      f = "/proc/" p "/stat"; if ((getline s < f) <= 0) exit 1; close(f)
      sub(/.*\) /, "", s); split(s, w, " "); p = w[2]
      if (index(roots, " " p " ")) exit 0
    }
    exit 1 }'
}
above() {  # PID: the processes between it and the first of $roots, each followed by a space
  awk -v p="$1" -v roots="$roots" 'BEGIN {
    f = "/proc/" p "/stat"; if ((getline s < f) <= 0) exit; close(f); sub(/.*\) /, "", s); split(s, w, " "); p = w[2]
    for (n = 0; n < 4096 && p > 0 && !index(roots, " " p " "); n++) {
      printf "%s ", p
      f = "/proc/" p "/stat"; if ((getline s < f) <= 0) exit; close(f); sub(/.*\) /, "", s); split(s, w, " "); p = w[2]
    }
  }'
}
# workers named in workers/LOCAL_RANK as "PID RANK": those the launcher's zygote forked (their /proc
# environment is the launcher's: marker, no ranks), and a process a worker started that formed a
# group of its own (train.spawn; agent/progress_hook), whose environment holds its parent's ranks
parents=" "
if [ -d "$1/workers" ] && [ ! -L "$1/workers" ]; then
  for w in "$1"/workers/[0-9]*; do
    lrank=${w##*/}
    case $lrank in *[!0-9]*) continue ;; esac
    if [ ! -f "$w" ] || [ -L "$w" ]; then continue; fi
    read -r pid rank _ < "$w" 2>/dev/null || continue
    case $pid in ''|*[!0-9]*) continue ;; esac
    case $rank in ''|*[!0-9]*) rank="" ;; esac
    case $seen in *" $pid "*) continue ;; esac
    grep -qzxF -e "$marker" "/proc/$pid/environ" 2>/dev/null || continue
    ours "$pid" || continue
    parents="$parents$(above "$pid")"
    worker "$pid" "$rank" "$lrank"
  done
fi
# torchrun's workers: their environment holds the ranks. Not one: a worker that only started ranks
# of their own (an ancestor of one named above), or a process below a rank or such a worker (a data
# loader's worker, multiprocessing's resource tracker), which holds the environment it was started with
for p in /proc/[0-9]*; do
  pid=${p#/proc/}
  case "$seen$parents" in *" $pid "*) continue ;; esac
  grep -qzxF -e "$marker" "$p/environ" 2>/dev/null || continue
  rank=$(tr '\0' '\n' < "$p/environ" 2>/dev/null | sed -n 's/^RANK=\([0-9]\{1,9\}\)$/\1/p' | head -n 1)
  lrank=$(tr '\0' '\n' < "$p/environ" 2>/dev/null | sed -n 's/^LOCAL_RANK=\([0-9]\{1,9\}\)$/\1/p' | head -n 1)
  [ -n "$lrank" ] || continue
  ours "$pid" || continue
  below=0; for a in $(above "$pid"); do case "$seen$parents" in *" $a "*) below=1; break ;; esac; done
  [ $below = 0 ] || continue
  worker "$pid" "$rank" "$lrank"
done
echo "workers $found"
[ -n "$ask" ] && [ -n "$fr" ] || exit 0
i=0
while [ $i -lt 20 ]; do
  all=1; for pl in $fr; do fresh "$(head -c 64 "$1/fr-${pl#*:}" 2>/dev/null | cut -d ' ' -f 1)" || all=0; done
  [ $all = 1 ] && break; sleep 0.1; i=$((i+1))
done
for pl in $fr; do
  read -r tok seq op <<ANSWER
$(head -c 80 "$1/fr-${pl#*:}" 2>/dev/null | head -n 1 | tr -cd 'a-z0-9_ .-')
ANSWER
  fresh "$tok" && [ -n "$seq" ] && [ "$seq" != none ] && echo "fr ${pl%%:*} $seq ${op:-?}"
done
exit 0
