# as_job COMMAND...: runs COMMAND with the job's rights when the job's user is not this one: as uid
# $job_uid, its group alone, when this shell runs as root and job_uid is set (the docker runtime's
# job, uid 1000); else as this user (the host runtime's job is the SSH user itself). What the job
# wrote is read, and what it owns removed, this way: a link it planted then leads nowhere it could
# not read or remove itself.
as_job() {
  if [ -n "${job_uid:-}" ] && [ "$(id -u)" = 0 ] && [ "$job_uid" != 0 ]; then
    setpriv --reuid="$job_uid" --regid="$job_uid" --clear-groups -- "$@"
  else "$@"; fi
}
