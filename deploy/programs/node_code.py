"""Runs on a node (``python3 -c <this file> MODE STORE SNAPSHOT``): the receiving end of a code sync.

Standard library only, Python 3.6+, no import of this package: it is sent as a string and run by
the node's interpreter. The store on the shared volume holds

    STORE/objects/KEY               one file per content (KEY: sha256 hex, ``.x`` when executable)
    STORE/snapshots/ID/...          a read-only tree of hard links to objects, ``.ddp-manifest.json``

MODE ``need``: stdin is the manifest (JSON: [[path, key, size], ...]); prints ``present`` when the
snapshot exists and holds exactly the manifest's files, else every key the store lacks, one per line.

MODE ``put``: stdin is a tar of ``objects/KEY`` members and ``manifest.json``. Every object is
checked against its key's sha256 before it enters the store, then the snapshot is built in a
temporary directory and renamed into place, so a snapshot that exists is complete.

Nothing already in the store is trusted: anyone who can write the shared volume could have put a
file there. An object is used only when it is a regular file of ours (or root's), writable by no
one else (a snapshot's files are hard links to it: another owner could change it after the check)
and its content has its key's sha256; ``need`` lists one that is not as lacking, and the build
checks each object again before linking it. A snapshot that differs from the manifest (a file
changed, missing, or added: a program run as root wrote into it) is moved aside, never deleted
(what a program wrote may be a checkpoint), and built again; ``need`` prints
``moved PATH: ...`` naming it and what differed.
"""

import hashlib
import json
import os
import shutil
import stat
import sys
import tarfile
import tempfile
import time

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


OWNERS = set()
"""Who a file we trust in the store may belong to (``learn_owners``)."""


def learn_owners(store):
    """Root, us, and whoever a file this process makes in the store belongs to (a root-squashing
    NFS server gives root's files to nobody)."""
    objects = os.path.join(store, "objects")
    OWNERS.update({0, os.geteuid()})
    try:
        os.makedirs(objects, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".owner-", dir=objects)
        OWNERS.add(os.fstat(fd).st_uid)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        fail("cannot write the code store %s: %s" % (objects, e.strerror or e))


def sound(path, key=None):
    """Whether the file at ``path`` can be trusted as the content of ``key`` (``key`` None: only
    that it is a regular file of ours, writable by no one else)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022 or st.st_uid not in OWNERS:
        return False
    return key is None or digest(path) == key.split(".")[0]


def discard(path):
    """Removes a bad store entry, whatever it is (a file, a link, a directory)."""
    if os.path.isdir(path) and not os.path.islink(path):
        remove_tree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def differences(tree, entries, limit=5):
    """How the snapshot at ``tree`` differs from the manifest: up to ``limit`` paths, each with
    what is wrong; [] when it holds exactly the manifest's files."""
    wanted = dict((e[0], e[1]) for e in entries)
    wanted[MANIFEST] = None
    found = []
    for root, dirs, files in os.walk(tree):
        for name in dirs + files:
            full = os.path.join(root, name)
            if name in files or os.path.islink(full):
                found.append(os.path.relpath(full, tree).replace(os.sep, "/"))
    said = []
    for rel in sorted(set(found) - set(wanted)):
        said.append("%s (not part of the code: written there)" % json.dumps(rel))
    for rel in sorted(set(wanted) - set(found)):
        said.append("%s (missing)" % json.dumps(rel))
    for rel in sorted(set(found) & set(wanted)):
        if not sound(os.path.join(tree, rel), wanted[rel]):
            said.append("%s (changed)" % json.dumps(rel))
    return said[:limit] + (["and %d more" % (len(said) - limit)] if len(said) > limit else [])


def need(store, snapshot):
    entries = json.load(sys.stdin)
    final = os.path.join(store, "snapshots", snapshot)
    if os.path.lexists(final):
        said = differences(final, entries)
        if not said:
            print("present")
            return
        # Beside it (a read-only directory cannot move to another parent), under a name no sync uses.
        aside = "%s.moved-%d-%d" % (final, int(time.time()), os.getpid())
        os.rename(final, aside)
        print("moved %s: %s" % (aside, "; ".join(said)))
    objects = os.path.join(store, "objects")
    for key in sorted({e[1] for e in entries}):
        path = os.path.join(objects, key)
        if not sound(path, key):
            try:
                discard(path)
            except OSError as e:
                fail("object %s in the store is not what its name says and cannot be replaced (%s); "
                     "remove it as its owner" % (path, e.strerror or e))
            print(key)


def receive_objects(store, tar):
    """Objects into the store (verified), and the manifest, from the tar on stdin."""
    objects = os.path.join(store, "objects")
    os.makedirs(objects, exist_ok=True)
    manifest = None
    received = set()
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
        discard(os.path.join(objects, key))  # os.replace cannot replace a directory planted there
        os.replace(tmp, os.path.join(objects, key))
        received.add(key)
    if manifest is None:
        fail("the code stream has no manifest")
    return manifest, received


def build(store, snapshot, entries, received=()):
    """The snapshot from the store's objects; those not ``received`` (checked on arrival) just
    now are checked again first."""
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
        if not os.path.lexists(source):
            remove_tree(work)
            fail("object %s for %s is missing from the store; launch again" % (key, path))
        if key not in received and not sound(source, key):
            discard(source)
            remove_tree(work)
            fail("object %s for %s in the store was not what its name says (content, owner or mode: "
                 "something wrote there); removed it, launch again to send it anew" % (key, path))
        received = set(received) | {key}
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


def own_dirs(store, owners=None):
    """Fails unless each of the store's directories that exists (the tool's directory above it, the
    store, its objects and snapshots) is a directory, not a link, that only its owner can write, and
    (``owners``) belongs to one of them. The store sits in the job's checkpoint directory: a part the
    job replaced would take this program's writes, chmods and links wherever it points."""
    for path in (os.path.dirname(store), store, os.path.join(store, "objects"), os.path.join(store, "snapshots")):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o022 or (owners is not None and st.st_uid not in owners):
            fail("%s is not the code store's own directory (owner %d, mode %o): a job may have replaced it; "
                 "move it aside and sync again" % (path, st.st_uid, st.st_mode))


def remove_tree(path):
    for root, dirs, files in os.walk(path):
        os.chmod(root, 0o755)
    shutil.rmtree(path, ignore_errors=True)


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("need", "put"):
        fail("usage: node_code need|put STORE SNAPSHOT")
    mode, store, snapshot = sys.argv[1:]
    own_dirs(store)
    learn_owners(store)
    own_dirs(store, OWNERS)
    if mode == "need":
        need(store, snapshot)
        return
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        entries, received = receive_objects(store, tar)
    build(store, snapshot, entries, received)
    print("stored")


if __name__ == "__main__":
    main()
