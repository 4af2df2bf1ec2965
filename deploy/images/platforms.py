"""The nodes' platform and the image's: every node's (``docker version``'s ``Server.Os/Server.Arch``;
``uname -sm`` on the host runtime, in Docker's names) must be the same (one image serves one
platform), the build passes it as ``--platform`` (accepted by both builders; the classic builder
cannot build for another architecture than its daemon's, and may even tag its own), and the
image's own platform (``docker image inspect``) must equal the nodes' before anything is shipped:
an image of another architecture would only fail later with "exec format error" in the job's
restart loop."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import RuntimeFailure
from ..inventory import Inventory
from ..nodes.remote import Remote, run_here


def inspect_argv(name: str, fmt: str) -> list[str]:
    return ["docker", "image", "inspect", "--format", fmt, name]


IMAGE_PLATFORM = "{{.Os}}/{{.Architecture}}"

NODE_PLATFORM_ARGV = {
    "docker": ("docker", "version", "--format", "{{.Server.Os}}/{{.Server.Arch}}"),
    "host": ("uname", "-sm"),
}
"""What tells a node's platform, by runtime: the engine's for containers, the kernel's otherwise."""


def node_platform_argv(inv: Inventory) -> tuple[str, ...]:
    return NODE_PLATFORM_ARGV[inv.job.runtime]


UNAME_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm",
              "armv6l": "arm", "i386": "386", "i686": "386", "ppc64le": "ppc64le", "s390x": "s390x",
              "riscv64": "riscv64"}
"""``uname -m`` -> Docker's (Go's) architecture names."""

_PLATFORM = re.compile(r"[a-z0-9]+/[a-z0-9]+")


def parse_platform(text: str) -> str | None:
    """``linux/amd64`` (docker) or ``Linux x86_64`` (uname -sm) -> ``linux/amd64``; None if neither."""
    text = text.strip()
    if _PLATFORM.fullmatch(text):
        return text
    words = text.split()
    if len(words) == 2 and words[1] in UNAME_ARCH:
        return f"{words[0].lower()}/{UNAME_ARCH[words[1]]}"
    return None


def node_platforms(inv: Inventory, remote: Remote) -> dict[str, str]:
    """Every node's platform (one short command each)."""
    argv = node_platform_argv(inv)
    results = remote.run({n.name: argv for n in inv.nodes}, what="reading the platform", timeout=60,
                         hint=f"`{' '.join(argv)}` must work on the node")
    out, bad = {}, {}
    for node, r in results.items():
        platform = parse_platform(r.stdout)
        if platform is None:
            bad[node] = r
        out[node] = platform
    if bad:
        raise RuntimeFailure(f"cannot tell the platform of {', '.join(bad)} from "
                             f"`{' '.join(argv)}`: {next(iter(bad.values())).stdout.strip()!r}")
    return out


def mixed(platforms: Mapping[str, str]) -> str | None:
    """None when every node has the same platform, else the nodes of each, in one line."""
    by: dict[str, list[str]] = {}
    for node, platform in platforms.items():
        by.setdefault(platform, []).append(node)
    if len(by) < 2:
        return None
    return "; ".join(f"{', '.join(nodes)}: {platform}" for platform, nodes in by.items())


def one_platform(platforms: Mapping[str, str]) -> str:
    """The nodes' one platform; nodes of several are refused (one image serves one platform)."""
    kinds = mixed(platforms)
    if kinds:
        raise RuntimeFailure(f"the nodes are of different platforms ({kinds}) and one image serves one "
                             "platform", hint="run the job on nodes of one platform: leave the others out "
                                              "with --without NODE, or give each platform its own hosts.yaml")
    return next(iter(platforms.values()))


def image_platform(name: str) -> str:
    r = run_here(inspect_argv(name, IMAGE_PLATFORM))
    platform = parse_platform(r.stdout) if r.ok else None
    if platform is None:
        raise RuntimeFailure(f"cannot read the platform of {name} here: {r.summary()}", field="image.name")
    return platform


def local_platform() -> str | None:
    """This machine's docker engine's platform (what its classic builder builds for)."""
    r = run_here(NODE_PLATFORM_ARGV["docker"])
    return parse_platform(r.stdout) if r.ok else None


CROSS_BUILD = ("building for another architecture needs BuildKit (the docker buildx plugin) and qemu "
               "registered with binfmt_misc (`docker run --privileged --rm tonistiigi/binfmt --install all`, "
               "or the qemu-user-static package), or a build machine of the nodes' platform")


OTHER_PLATFORM = "does not match the specified platform"
"""The classic builder's error for a --platform other than its daemon's."""


def refuse_other_platform(inv: Inventory, platforms: Mapping[str, str], *, built: bool) -> str:
    """The image's platform, when it is every node's; else refused naming the nodes and both
    platforms (nothing has been shipped yet)."""
    have = image_platform(inv.image.name)
    wrong = [n for n, p in platforms.items() if p != have]
    if not wrong:
        return have
    want = platforms[wrong[0]]
    if built:
        here = local_platform()
        hint = (f"docker build --platform {want} gave an image of {have}"
                + (f" (this machine's docker is {here})" if here else "") + f": {CROSS_BUILD}")
    else:
        hint = f"drop --no-build: deploy builds it with --platform {want}; {CROSS_BUILD}"
    raise RuntimeFailure(f"image {inv.image.name} is {have} but {', '.join(wrong)} "
                         f"{'is' if len(wrong) == 1 else 'are'} {want}: nothing shipped", hint=hint)


