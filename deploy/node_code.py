"""Runs on a node (``python3 -c <this file> MODE STORE SNAPSHOT``): the receiving end of a code sync.

Standard library only, Python 3.6+, no import of this package: it is sent as a string and run by
the node's interpreter. The store on the shared volume holds

    STORE/objects/KEY               one file per content (KEY: sha256 hex, ``.x`` when executable)
    STORE/snapshots/ID/...          a read-only tree of hard links to objects, ``.ddp-manifest.json``

MODE ``need``: stdin is the manifest (JSON: [[path, key, size], ...]); prints ``present`` when the
snapshot exists, else every key the store lacks, one per line.

MODE ``put``: stdin is a tar of ``objects/KEY`` members and ``manifest.json``. Every object is
checked against its key's sha256 before it enters the store, then the snapshot is built in a
temporary directory and renamed into place, so a snapshot that exists is complete.
"""

import hashlib
import json
import os
import shutil
import stat
import sys
import tarfile
import tempfile

MANIFEST = ".ddp-manifest.json"


def fail(message):
    sys.stderr.write(message + "\n")
    sys.exit(1)


def digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def need(store, snapshot):
    entries = json.load(sys.stdin)
    if os.path.isfile(os.path.join(store, "snapshots", snapshot, MANIFEST)):
        print("present")
        return
    objects = os.path.join(store, "objects")
    for key in sorted({e[1] for e in entries}):
        if not os.path.isfile(os.path.join(objects, key)):
            print(key)


def receive_objects(store, tar):
    """Objects into the store (verified), and the manifest, from the tar on stdin."""
    objects = os.path.join(store, "objects")
    os.makedirs(objects, exist_ok=True)
    manifest = None
    for member in tar:
        if member.name == "manifest.json" and member.isfile():
            manifest = json.loads(tar.extractfile(member).read().decode())
            continue
        key = member.name[len("objects/"):] if member.name.startswith("objects/") else ""
        if not member.isfile() or not key or "/" in key or key.startswith("."):
            fail("unexpected member in the code stream: %r" % member.name)
        fd, tmp = tempfile.mkstemp(prefix=".in-", dir=objects)
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(tar.extractfile(member), out)
        if digest(tmp) != key.split(".")[0]:
            os.unlink(tmp)
            fail("object %s arrived damaged (sha256 differs); nothing was kept" % key)
        os.chmod(tmp, 0o555 if key.endswith(".x") else 0o444)
        os.replace(tmp, os.path.join(objects, key))
    if manifest is None:
        fail("the code stream has no manifest")
    return manifest


def build(store, snapshot, entries):
    snapshots = os.path.join(store, "snapshots")
    final = os.path.join(snapshots, snapshot)
    if os.path.isfile(os.path.join(final, MANIFEST)):
        return
    os.makedirs(snapshots, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".build-", dir=snapshots)
    objects = os.path.join(store, "objects")
    for path, key, _size in entries:
        if path.startswith("/") or ".." in path.split("/"):
            fail("unsafe path in the manifest: %r" % path)
        source = os.path.join(objects, key)
        if not os.path.isfile(source):
            fail("object %s for %s is missing from the store" % (key, path))
        target = os.path.join(work, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(source, target)
        except OSError:  # a file system without hard links: a copy
            shutil.copy2(source, target)
    with open(os.path.join(work, MANIFEST), "w") as f:
        json.dump(entries, f)
    for root, dirs, files in os.walk(work):
        for name in files:
            os.chmod(os.path.join(root, name), stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) & 0o555)
    for root, dirs, files in os.walk(work, topdown=False):
        os.chmod(root, 0o555)
    try:
        os.rename(work, final)
    except OSError:
        if not os.path.isfile(os.path.join(final, MANIFEST)):
            raise
        remove_tree(work)  # another sync of the same snapshot won the race


def remove_tree(path):
    for root, dirs, files in os.walk(path):
        os.chmod(root, 0o755)
    shutil.rmtree(path, ignore_errors=True)


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("need", "put"):
        fail("usage: node_code need|put STORE SNAPSHOT")
    mode, store, snapshot = sys.argv[1:]
    if mode == "need":
        need(store, snapshot)
        return
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        entries = receive_objects(store, tar)
    build(store, snapshot, entries)
    print("stored")


if __name__ == "__main__":
    main()
