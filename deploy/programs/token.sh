q=$1; while [ ! -e "$q" ]; do q=$(dirname "$q"); done
if [ ! -d "$q" ] || [ ! -w "$q" ]; then echo "$q is not a writable directory" >&2; exit 3; fi
p="${q%/}/.ddp-deploy-check-$2"
echo "$p"
printf %s "$2" > "$p"
