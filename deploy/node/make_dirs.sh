mode=$1; data=$2; ckpt=$3
mkdir -p "$data" "$ckpt" || exit 1
if [ "$mode" = chown ] && [ "$(id -u)" = 0 ]; then
  job_uid=1000  # the image's user: its data directory is its own, the checkpoint directory shared (job_root)
  chown "$job_uid:$job_uid" -- "$data" && job_root "$ckpt" || exit 1
else for d in "$data" "$ckpt"; do [ -w "$d" ] || { echo "$d is not writable by $(id -un)" >&2; exit 1; }; done
fi
