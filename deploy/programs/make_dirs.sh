job_uid=$1; data=$2; ckpt=$3
mkdir -p "$data" "$ckpt" || exit 1
if [ -n "$job_uid" ] && [ "$(id -u)" = 0 ]; then
  # the job's data directory is its own, the checkpoint directory shared with this tool (job_root)
  chown "$job_uid:$job_uid" -- "$data" && job_root "$ckpt" || exit 1
else for d in "$data" "$ckpt"; do [ -w "$d" ] || { echo "$d is not writable by $(id -un)" >&2; exit 1; }; done
fi
