# docker_store: the node's image store, "containerd" (the containerd image store reports the driver
# type io.containerd.snapshotter.v1) or "classic"; fails as `docker info` does.
docker_store() {
  driver=$(docker info --format '{{json .DriverStatus}}') || return
  case $driver in *io.containerd.snapshotter*) echo containerd ;; *) echo classic ;; esac
}
