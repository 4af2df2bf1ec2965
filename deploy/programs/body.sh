addrs=""
for n in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  a=$(scontrol show node -o "$n" | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
  addrs="$addrs $n=${a:-$n}"
done
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
echo "ddp-deploy: Slurm job $SLURM_JOB_ID, start $((${SLURM_RESTART_COUNT:-0} + 1)), nodes:$addrs, rendezvous on $head"
