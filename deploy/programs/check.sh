part=$1
for t in sbatch squeue scontrol scancel srun; do command -v $t > /dev/null || { echo "tools missing: $t"; exit 0; }; done
echo "tools ok"
if [ -n "$part" ]; then s=$(sinfo -h -p "$part" -o '%a %D %T' 2>&1); else s=$(sinfo -h -o '%a %D %T' 2>&1); fi
echo "sinfo ${s:-none}" | tr '\n' ';'; echo
for d in "$2" "$3"; do
  mkdir -p "$d" 2>/dev/null && [ -w "$d" ] && echo "dir ok $d" || echo "dir missing $d"
done
exit 0
