launch_id() {
  lid=$(docker inspect --type container --format '{{range .Config.Env}}{{println .}}{{end}}' "$1" 2>/dev/null |
       sed -n 's/^DDP_LAUNCH_ID=//p' | head -n 1)
  printf '%s\n' "$lid" | grep -qxE '[0-9]{8}-[0-9]{6}-[0-9a-f]{4}' && printf '%s' "$lid"
}
