for p in "$@"; do
  q=$p; while [ ! -e "$q" ]; do q=$(dirname "$q"); done
  if [ ! -d "$q" ] || [ ! -w "$q" ]; then echo "FAIL $p $q is not a writable directory"; continue; fi
  kb=$(df -Pk "$q" | awk 'NR==2 {print $4}')
  if [ "$q" = "$p" ]; then echo "OK $p $kb"; else echo "MISSING $p $kb $q"; fi
done
