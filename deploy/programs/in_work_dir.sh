# $1 = the node's working directory, then the command: the host runtime's working directory without
# train.code ($DDP_CKPT_DIR/work/<node>, agent/workdir.py), the same for the check's probe and the
# job. Made where absent, by the user the job runs as (the host runtime's job is the SSH user's).
dir=$1; shift
mkdir -p -- "$dir" && cd -- "$dir" || exit 1
exec "$@"
