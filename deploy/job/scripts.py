"""The node-side shell programs of a job's runtimes, as text: what `launch`, `status`, `stop` and
`logs` run on a node (deploy/job/runtime.py puts them on argv lists; most are files in deploy/programs/,
checked by shellcheck, and the few spliced here from shared parts are too:
tests/test_node_programs.py). Nothing here runs."""

from __future__ import annotations

from agent.contract import FORMED_MARKER, STALL_RECORD_ENV, program

from ..programs import node_program


# A shell function: kill_run RUNDIR [PID] kills every process of this user (all four uids) whose
# environment carries the run's DDP_DEPLOY_RUN=RUNDIR marker (torchrun and its workers, which live
# in sessions of their own), except PID: another user's process that sets the marker is left
# alone. The marker is compared as a fixed string (-F), whole (-x): as a pattern, the run directory
# of job exp.1 would match exp-1's, and one job's stop or end would kill the other.
# One grep reads every process's environment (one a process took seconds on a busy node), and it
# returns once the killed are gone (at most 5 s): a stop that says stopped leaves none of them.
# No single quote in it: the supervisor's script below is one quoted word.
# The jobs' launchers on a node and the GPUs they hold (agent/holds.py: standard library only, run
# by the node's own python3): `list INDEX...`, `jobs`.
HOLDS = program("holds")

KILL_RUN = node_program("kill_run.sh")

# Shell functions: tool_dir ROOT NAME... makes and checks a directory only this tool writes, below
# the checkpoint directory ROOT; job_root ROOT makes ROOT the job's to write into, but not to rename
# what this tool keeps there; run_dir ROOT SUB JOB RUN, both for a run's directory.
TOOL_DIR = node_program("tool_dir.sh")

# reuse|keep, the probe command's key, the image's name, then the probe's argv: a CPU node's good
# probe answer kept for the next launch in the same image with the same command.
PROBE_KEPT = node_program("probe_kept.sh")
# reuse|keep, the probe command's key, then the probe's argv: a host CPU node's good probe answer
# kept by agent.probe for the next launch with the same command and installation.
HOST_PROBE_KEPT = node_program("probe_kept_host.sh")

# Filters of a run's log (stdin). A worker's lines start with its rank, "[rank3]: " (put there by
# the launcher, agent/launch.py; twice on a traceback, whose lines torch prefixes too).
# Rank 0's last METRICS line (no prefix, or "[rank0]: "), without its prefix:
LAST_METRICS = node_program("last_metrics.sh")
# What the program said on a planned stop (trainer/stopping.py), as ": <its line>", if anything:
# its last such line, unless the job resumed after it (a METRICS line of kind "resumed": torchrun
# started its workers again, from that stop's checkpoint). A stop reaches the nodes one after
# another, and a node's ranks may have stopped by it (the others told them) before that node's own
# stop begins: its line is then older than the stop, and still this stop's. (Only "resumed": a
# worker's stdout and stderr reach the log through two pipes, so its METRICS lines of the steps
# before the stop may come after the stop's line.)
STOPPED_LINE = node_program("stopped_line.sh")

# A shell function: record_stop KEPT SCOPE MODE BY TIME [said], stdin: the end of what the program
# printed in this run. Keeps the stop with the run: KEPT.stopped, one line "TIME SCOPE MODE STEP BY"
# (runs.Stop reads it), STEP the step the program said it checkpointed at ("-": it said none). It
# sits beside the node's directory of the run, in the run's, which only this tool writes: the
# node's own is the job's, where a link it planted would take this write anywhere. Only
# the number is kept of the program's line: its text is the job's, and may hold anything. Prints
# what the program said (STOPPED_LINE), and that the stop is not recorded where KEPT cannot be
# written. With a 6th word "said": nothing is kept or printed unless the program said it stopped
# (a node whose part had already ended: by this stop, which its ranks heard of from the others).
RECORD_STOP = r"""record_stop() {
  said=$(""" + STOPPED_LINE + r""")
  [ "$6" = said ] && [ -z "$said" ] && return 0
  step=$(printf '%s\n' "$said" | sed -n -E 's/.*stopped by .* at step ([0-9]{1,18})([^0-9].*)?$/\1/p')
  if [ -n "$1" ] && { echo "$5 $2 $3 ${step:--} $4" > "$1.stopped.tmp" && mv "$1.stopped.tmp" "$1.stopped"; } 2>/dev/null
  then printf '%s' "$said"
  else printf '%s (the stop is not recorded%s)' "$said" "${1:+ in $1}"; fi
}
"""

# A shell function: begin_stop KEPT SCOPE MODE BY TIME keeps, before the stop signals anything, that
# it has begun (KEPT.stopped, as RECORD_STOP writes it, the step not yet said): from then on
# `status` shows the node "stopping", then "stopped" once the run's handle (pid file, container) is
# gone, and `launch --wait` ends as a stop, never on the failure its ranks' ends may look like. The
# record of the end (RECORD_STOP) replaces it, before the handle goes.
BEGIN_STOP = r"""begin_stop() {
  [ -n "$1" ] && { echo "$5 $2 $3 - $4" > "$1.stopped.tmp" && mv "$1.stopped.tmp" "$1.stopped"; } 2>/dev/null
  return 0
}
"""

# A shell function: formed KEPT prints "formed" where the node's launcher kept, in its directory of
# the run KEPT, that a rank's heartbeat was seen (agent/formed.py). The directory is the job's: the
# file is looked at with its rights.
FORMED = r"""formed() {
  [ -n "$1" ] && as_job test -e "$1/""" + FORMED_MARKER + r"""" 2>/dev/null && echo formed
  return 0
}
"""

# A shell function: stop_line STOPPED prints the first line of a stop's record (RECORD_STOP,
# BEGIN_STOP), where there is one. It sits in the run's directory, which only this tool writes.
STOP_LINE = r"""stop_line() {
  [ -f "$1" ] && head -c 300 "$1" 2>/dev/null | head -n 1
  return 0
}
"""

# $1 = the node's state dir, $2 = its directory of this run (runs.py), $3 = max restarts, $4... =
# the command. Refuses when a previous run is recorded. The command's output goes to the run's
# log (STATE/log links to it: status, logs and stop read the running one there), and each end
# of it adds "TIME CODE" to the run's exits.
# Starts the command in its own session (setsid), so `stop` can signal the whole process group,
# under a supervisor loop that does for the host runtime what Docker's restart policy does for
# containers: a command that exits non-zero (its torchrun killed, the OOM killer) is started
# again, at most max-restarts times, and rejoins the job's next rendezvous round. Whatever the
# command left (torchrun's workers live in sessions of their own) is killed first, as a
# container's end takes every process in it. A signal to the
# group (stop) ends the supervisor too, so a stopped job is never started again. Waits for the
# pid file, then 1 s more so that an immediate failure (bad interpreter) is reported: the supervisor
# writes "ending" (the last exit code) as soon as the command ended for good, before it kills what
# the command left and writes "exit", so however long that takes on a busy node, a command that
# ended within the second is reported.
HOST_START = r"""run=$1; kept=$2; shift 2
if [ -e "$run/pid" ]; then echo "a previous run is recorded in $run (run: ddp-deploy stop)" >&2; exit 3; fi
mkdir -p "$run" "$kept" || exit 1
rm -f "$run/exit" "$run/ending" "$run/restarts"
ln -sfn "$kept/log" "$run/log" || exit 1
DDP_DEPLOY_RUN=$run; export DDP_DEPLOY_RUN
""" + STALL_RECORD_ENV + "=$kept; export " + STALL_RECORD_ENV + r"""  # where the launcher keeps a stall (agent/heartbeat/)
# shellcheck disable=SC2016  # the supervisor's script expands its own arguments
setsid sh -c '""" + KILL_RUN + r"""
run=$0; kept=$1; max=$2; shift 2; echo $$ > "$run/pid.tmp" && mv "$run/pid.tmp" "$run/pid"; n=0
while :; do
  "$@" >> "$kept/log" 2>&1 < /dev/null; rc=$?
  last=no; { [ $rc = 0 ] || [ $n -ge "$max" ]; } && last=yes
  [ $last = yes ] && echo $rc > "$run/ending.tmp" && mv "$run/ending.tmp" "$run/ending"
  echo "$(date +%s) $rc" >> "$kept/exits"
  kill_run "$run" $$
  [ $last = yes ] && break
  n=$((n+1)); echo $n > "$run/restarts"
  echo "ddp-deploy: exited with $rc; starting it again ($n of $max restarts)" >> "$kept/log"; sleep 1
done
echo $rc > "$run/exit"' "$run" "$kept" "$@" < /dev/null > /dev/null 2>&1 &
i=0; while [ ! -s "$run/pid" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
[ -s "$run/pid" ] || { echo "process did not start" >&2; exit 1; }
sleep 1
if [ -e "$run/ending" ]; then
  i=0; while [ ! -e "$run/exit" ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
  if [ "$(cat "$run/ending")" != 0 ]; then
    echo "exited with $(cat "$run/ending") at once: $(tail -n 3 "$run/log" | tr '\n' ' ')" >&2; exit 1
  fi
fi
cat "$run/pid"
"""

# A shell function: as_job COMMAND... runs COMMAND with the job's rights (as_job.sh: job_uid).
AS_JOB_LIB = node_program("as_job.sh")

# A shell function: progress HEARTBEAT_DIR LOG. The evidence of progress of a running job on this
# node, its ages in seconds as this node's clock has them: "beat LOCAL_RANK AGE LINE" for each
# rank's heartbeat file (agent/heartbeat/; LINE: its first line's digits and spaces, the file
# being the job's), and "quiet AGE", the time since the run's log was last written.
PROGRESS = AS_JOB_LIB + node_program("progress.sh")

# A shell function: last_stall KEPT prints "stall LINE", the last stall the node's launcher kept
# in the run's directory KEPT (agent/heartbeat/, Watchdog; job.on_stall: stop ends a node so).
LAST_STALL = node_program("last_stall.sh")

# $1 = run dir, $2 = the job's heartbeat dir. Line 1: absent | running | stopping | stopped |
# exited CODE; then "stop LINE" (the record of the operator's stop of this run, where one is kept),
# "restarts N" (the supervisor's count), a running job's PROGRESS, an ended one's LAST_STALL,
# "formed" (FORMED) and the last METRICS line, if any. A run with a stop's record is "stopping"
# while its pid file is there (HOST_STOP removes it last), "stopped" after.
HOST_STATUS = PROGRESS + LAST_STALL + FORMED + STOP_LINE + r"""run=$1
kept=$(readlink "$run/log" 2>/dev/null); kept=${kept%/log}
stop=""; [ -n "$kept" ] && stop=$(stop_line "$kept.stopped")
if [ ! -e "$run/pid" ]; then
  [ -n "$stop" ] || { echo absent; exit 0; }
  echo stopped
elif [ -n "$stop" ]; then echo stopping
elif [ -e "$run/exit" ]; then echo "exited $(cat "$run/exit")"; [ -n "$kept" ] && last_stall "$kept"
elif kill -0 "-$(cat "$run/pid")" 2>/dev/null; then echo running; progress "$2" "$run/log"
else echo "exited ?"
fi
[ -n "$stop" ] && echo "stop $stop"
formed "$kept"
echo "restarts $(cat "$run/restarts" 2>/dev/null || echo 0)"
[ -e "$run/log" ] && cat "$run/log" | """ + LAST_METRICS + r"""
exit 0
"""

# A shell function: drop_beats DIR removes a stopped job's heartbeat directory (a launcher killed
# at once leaves it), where it is a directory and not a link.
DROP_BEATS = node_program("drop_beats.sh")

# $1 = run dir, $2 = grace in seconds (0: kill at once), $3 = who stops it (user@host), $4 = the job's
# heartbeat dir. SIGTERM
# to the process group if it still runs: torchrun passes it to its workers, which finish their
# step, write a checkpoint and exit (trainer/stopping.py) within torchrun's 30 s; after the
# grace, SIGKILL. torchrun starts each worker in a session of its own, so the group does not hold
# them: every process still carrying this run's DDP_DEPLOY_RUN marker in its environment is
# killed last. A job found running has its stop kept with the run (RECORD_STOP: the run's
# directory is where STATE/log links). Then the run is forgotten (log kept). Prints what the
# program said on stopping, if anything (STOPPED_LINE: never the line of an earlier stop that the
# job went on from). A run that had ended before the stop began, whose program said it stopped,
# stopped by this stop: its ranks heard of it from another node's, which began first.
HOST_STOP = KILL_RUN + RECORD_STOP + BEGIN_STOP + DROP_BEATS + r"""run=$1; grace=$2; by=$3; beats=$4
kept=$(readlink "$run/log" 2>/dev/null); kept=${kept%/log}
log_end() { tail -c 4000000 "$run/log" 2>/dev/null; }  # what this run printed last (STOPPED_LINE reads it)
if [ -e "$run/pid" ] && [ ! -e "$run/exit" ]; then
  pid=$(cat "$run/pid"); t0=$(date +%s); mode=now; [ "$grace" -gt 0 ] && mode=graceful
  alive=no; kill -0 "-$pid" 2>/dev/null && alive=yes
  [ $alive = yes ] && begin_stop "$kept" node "$mode" "$by" "$t0"
  if [ "$grace" -gt 0 ]; then
    kill -TERM "-$pid" 2>/dev/null
    i=0; while kill -0 "-$pid" 2>/dev/null && [ $i -lt $((grace * 10)) ]; do sleep 0.1; i=$((i+1)); done
  fi
  kill -KILL "-$pid" 2>/dev/null
  kill_run "$run" ""
  said=""
  [ $alive = yes ] && said=$(log_end | record_stop "$kept" node "$mode" "$by" "$t0")
  drop_beats "$beats"
  echo "stopped$said"
elif [ -e "$run/pid" ]; then
  # ended before this stop began: by this stop all the same where the program says it stopped
  # (its ranks heard of it from another node's), else on its own
  said=""; [ "$grace" -gt 0 ] && said=$(log_end | record_stop "$kept" node graceful "$by" "$(date +%s)" said)
  if [ -n "$said" ]; then echo "stopped$said"; else echo "cleared (had exited $(cat "$run/exit"))"; fi
else echo absent
fi
rm -f "$run/pid" "$run/exit" "$run/ending"
"""

# A shell function: launch_id CONTAINER prints the run id (runs.py) in the container's DDP_LAUNCH_ID,
# and fails where it holds none of that exact shape: the job's kept directory is named by it.
LAUNCH_ID = node_program("launch_id.sh")

# $1 = container, $2 = the job's heartbeat dir, $3 = the job's directory (as the node sees it), $4 =
# the node, $5 = the job's uid (its files are read with its rights: as_job.sh). The same lines as
# HOST_STATUS (restarts: Docker's RestartCount; the log: the run's copy, named by the container's
# DDP_LAUNCH_ID), and "restarting" while Docker starts it again. A container whose run has a stop's
# record is "stopping" (DOCKER_STOP removes it last); no container, where the job's current run
# (launch.json, its "run" at the top level: one space of indent) has one, "stopped". Only "No such
# container" is absent: any other failure of the engine (busy) fails the command, so it reads as a
# node that did not answer this time, never as a job that ended.
DOCKER_STATUS = PROGRESS + LAST_STALL + LAUNCH_ID + FORMED + STOP_LINE + r"""c=$1; beats=$2; job=$3; node=$4; job_uid=$5
s=$(docker inspect --type container --format '{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}' "$c" 2>&1) || {
  case "$s" in
    *"o such container"*|*"o such object"*)
      run=$(head -c 4096 "$job/launch.json" 2>/dev/null | sed -n -E 's/^ "run": "([0-9]{8}-[0-9]{6}-[0-9a-f]{4})",?$/\1/p' | head -n 1)
      stop=""; [ -n "$run" ] && stop=$(stop_line "$job/runs/$run/$node.stopped")
      [ -n "$stop" ] || { echo absent; exit 0; }
      echo stopped; echo "stop $stop"; formed "$job/runs/$run/$node"
      as_job tail -c 1000000 -- "$job/runs/$run/$node/log" 2>/dev/null | """ + LAST_METRICS + r"""
      exit 0 ;;
  esac
  echo "$s" >&2; exit 1; }
set -- $s
run=$(launch_id "$c") || run=none
stop=$(stop_line "$job/runs/$run/$node.stopped")
if [ -n "$stop" ]; then echo stopping
else case "$1" in running|restarting) echo "$1" ;; *) echo "exited $2" ;; esac; fi
case "$1" in
  running) progress "$beats" "$job/runs/$run/$node/log" ;;
  restarting) ;;
  *) last_stall "$job/runs/$run/$node" ;;
esac
[ -n "$stop" ] && echo "stop $stop"
[ "$run" = none ] || formed "$job/runs/$run/$node"
echo "restarts ${3:-0}"
docker logs "$c" 2>&1 | """ + LAST_METRICS + r"""
exit 0
"""

# $1 = container, $2 = grace in seconds (0: remove at once), $3 = who stops it (user@host), $4 =
# the checkpoint directory, $5 = the tool's directory in it, $6 = the job, $7 = the node, $8 = the
# job's heartbeat dir. Idempotent. The stop is kept only where every directory above its record is
# this tool's alone (tool_dir). `docker stop` sends
# SIGTERM to the container's torchrun (the checkpoint of a planned stop, trainer/stopping.py)
# and SIGKILL after the grace; a container stopped so is never restarted by its policy. A
# container found running has its stop kept with its run (RECORD_STOP; the run's id is the
# container's DDP_LAUNCH_ID), with what it printed on stopping; so has one that had ended before
# the stop began and whose program said it stopped (as in HOST_STOP); one that ended on its own is
# cleared, its exit code said, as the host runtime's is.
DOCKER_STOP = RECORD_STOP + BEGIN_STOP + TOOL_DIR + DROP_BEATS + LAUNCH_ID + r"""c=$1; grace=$2; by=$3; root=$4; sub=$5; name=$6; node=$7
beats=$8
if s=$(docker inspect --type container --format '{{.State.Status}} {{.State.ExitCode}} {{.State.StartedAt}}' "$c" 2>/dev/null); then
  t0=$(date +%s); mode=now; [ "$grace" -gt 0 ] && mode=graceful
  # shellcheck disable=SC2086  # three words: the state, the exit code, the start
  set -- $s; s=$1; code=$2; started=$3
  run=$(launch_id "$c") && run_dir "$root" "$sub" "$name" "$run" 2>/dev/null && kept=$root/$sub/$name/runs/$run/$node || kept=""
  case "$s" in running|restarting) begin_stop "$kept" node "$mode" "$by" "$t0" ;; esac
  [ "$grace" -gt 0 ] && docker stop --time "$grace" "$c" > /dev/null 2>&1
  # what this start of the container printed (STOPPED_LINE takes the stop's line from its end)
  said=""; this_start() { docker logs --since "$started" --tail 20000 "$c" 2>&1; }
  case "$s" in
    running|restarting) said=$(if [ "$grace" -gt 0 ]; then this_start; fi | record_stop "$kept" node "$mode" "$by" "$t0") ;;
    *) [ "$grace" -gt 0 ] && said=$(this_start | record_stop "$kept" node "$mode" "$by" "$t0" said) ;;
  esac
  docker rm -f "$c" > /dev/null && drop_beats "$beats" || exit 1
  case "$s$said" in
    exited|dead) echo "cleared (had exited $code)" ;;  # ended before this stop began, on its own
    *) echo "stopped$said" ;;
  esac
else echo absent; fi
"""


# $1 = the job's uid ("": this user), then a command that reads what the job wrote (and this tool's
# records beside it, which anyone may read): run with the job's rights where this shell is root, as
# as_job.sh does, in the shell's place (a followed log ends with the session).
AS_JOB = ('u=$1; shift; if [ -n "$u" ] && [ "$(id -u)" = 0 ] && [ "$u" != 0 ]; then '
          'exec setpriv --reuid="$u" --regid="$u" --clear-groups -- "$@"; fi; exec "$@"')

MERGE_STDERR = 'exec "$@" 2>&1'

# $@ = the command. Exports NAME=VALUE lines read from stdin (the secrets: never on a command
# line, in a file or a log), then runs the command with them in its environment.
SECRETS_FROM_STDIN = 'while IFS= read -r kv; do export "$kv"; done; exec "$@"'

# $1 = directory, then the command: the host runtime's start in the code snapshot, from which the
# launcher makes the node's working directory of links to it (agent/workdir.py). File modes do
# not stop root (the default ssh.user): for root the snapshot is made read-only by a bind mount in
# a mount namespace of the command's own (util-linux unshare), so that a program writing through a
# link to its code fails at once instead of changing the snapshot every run of that code shares. Mounts the node makes later still reach the command
# (slave propagation); nothing of the namespace reaches the node. Where root cannot (no unshare,
# no CAP_SYS_ADMIN: a node that is itself an unprivileged container), the log says so and the
# command runs in the writable snapshot.
IN_DIR = node_program("in_dir.sh")

# $1 = the node's working directory without train.code, then the command (in_work_dir.sh).
IN_WORK_DIR = node_program("in_work_dir.sh")

# The node's directory of the run, made for the job's launcher, then the command (in_new_dir.sh).
IN_NEW_DIR = TOOL_DIR + node_program("in_new_dir.sh")

# $1 = container, then the command that runs it: a leftover of an interrupted run goes first.
REPLACE_CONTAINER = 'docker rm -f "$1" > /dev/null 2>&1; shift; exec "$@"'
