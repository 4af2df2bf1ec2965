# tool_dir ROOT NAME...: makes ROOT/NAME/... where missing (mode 0755) and checks every part below
# ROOT as it is reached: a directory of ours, not a link, that no one else can write. ROOT is the
# checkpoint directory, which the job writes into; what this tool keeps there is safe from the job
# only while the job cannot rename the parts or plant anything in them (ROOT ours and sticky, or
# writable by us alone: make_dirs.sh, in_new_dir.sh). Prints nothing; fails with a line naming the
# part that is not sound and what to do.
tool_dir() {
  td_path=$1; shift
  for td_name in "$@"; do
    td_path=$td_path/$td_name
    [ -e "$td_path" ] || [ -L "$td_path" ] || mkdir -m 0755 -- "$td_path" 2>/dev/null || [ -d "$td_path" ] || {
      echo "cannot make $td_path" >&2; return 1; }
    td_is=$(stat -c '%F %u %a' -- "$td_path" 2>/dev/null) || { echo "cannot read $td_path" >&2; return 1; }
    # shellcheck disable=SC2086  # three words: type (one word for a directory), owner, mode
    set -- $td_is "$@"
    if [ "$1 $2" != "directory $(id -u)" ] || [ $((0$3 & 022)) != 0 ]; then
      echo "$td_path is not this tool's own directory ($td_is): a job may have replaced it; move it aside and run the verb again" >&2
      return 1
    fi
    shift 3
  done
  return 0
}
# job_root ROOT: where the job runs as a user of its own (job_uid, as_job.sh) and this shell is root,
# ROOT (the checkpoint directory) is made root's, writable by the job's group, with the sticky bit:
# the job makes, renames and removes its own files there, never what this tool keeps beside them.
job_root() {
  if [ -n "${job_uid:-}" ] && [ "$(id -u)" = 0 ]; then chown "0:$job_uid" -- "$1" && chmod 1775 -- "$1"; fi
}
# run_dir ROOT SUB JOB RUN: the directory of a run, ROOT/SUB/JOB/runs/RUN, with every part made and
# checked (tool_dir), ROOT made on the way and handed to the job to write into (job_root).
run_dir() {
  mkdir -p -- "$1" && job_root "$1" && tool_dir "$1" "$2" "$3" runs "$4"
}
