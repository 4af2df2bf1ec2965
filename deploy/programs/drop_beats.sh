drop_beats() {
  if [ -d "$1" ] && [ ! -L "$1" ]; then rm -rf -- "$1"; fi
  return 0
}
