"""The image build here (deploy/images/build.py): both builders' real output read into steps (captured in
tests/build_logs), the failing step and its own output named, the output streamed as the build
runs and kept in a file, and the image's platform held against the nodes' before anything ships."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console

from deploy.cli import build_view
from deploy.images import build, build_log, platforms, prepare
from deploy.checks import node_checks, preflight
from deploy.errors import RuntimeFailure
from deploy.nodes.remote import Result
from fakes import install_command
from local_job import on_paper

LOGS = Path(__file__).resolve().parent / "build_logs"
WIDGET = 'RUN echo "compiling widget"; for i in 1 2 3; do echo "line $i"; done; echo "fatal: widget.c missing" >&2; exit 3'
WIDGET_OUTPUT = {"compiling widget", "line 1", "line 2", "line 3", "fatal: widget.c missing"}


def read(name: str) -> build_log.BuildLog:
    log = build_log.BuildLog()
    for raw in (LOGS / name).read_bytes().splitlines(keepends=True):
        log.feed(build_log.clean(raw))
    return log


def _inv(runtime="docker", nodes=("n1", "n2"), base_dir=Path("/repo")):
    return on_paper([{"name": n, "address": f"198.18.0.{11 + i}"} for i, n in enumerate(nodes)], job="img",
                    job_fields={"runtime": runtime}, image={"name": "t:1", "build_args": {"BASE_IMAGE": "local/cpu-base:1"}},
                    base_dir=base_dir)


# ------------------------------------------------------------------ reading both builders


@pytest.mark.parametrize("name, kind, step", [
    ("classic-fail.log", "classic", f"[4/5] {WIDGET}"),
    ("buildkit-docker20-fail.log", "buildkit", f"[3/4] {WIDGET}"),
    ("buildx-fail.log", "buildkit", f"[3/4] {WIDGET}"),
])
def test_a_failed_run_step_is_named_with_its_own_output_and_exit_code(name, kind, step):
    log = read(name)
    failure = log.failure(1)
    assert log.kind == kind
    assert failure.step == step
    assert sorted(failure.output) == sorted(WIDGET_OUTPUT)  # the step's lines, none of the builder's own
    assert failure.summary() == "exit code 3"


def test_interleaved_buildkit_stages_blame_the_failed_step_not_the_cancelled_one():
    """Interleaved BuildKit stages blame the step that failed, not the one cancelled beside it."""
    failure = read("buildx-multistage-fail.log").failure(1)
    assert failure.step == "[b 2/2] RUN for i in 1 2 3; do echo b$i; sleep 0.2; done; exit 5"
    assert failure.output == ("b1", "b2", "b3")
    assert failure.summary() == "exit code 5"


def test_a_classic_multistage_failure_keeps_only_the_failing_stage_s_output():
    failure = read("classic-multistage-fail.log").failure(5)
    assert failure.step.startswith("[5/7] RUN for i in 1 2 3; do echo b$i")
    assert failure.output == ("b1", "b2", "b3")


@pytest.mark.parametrize("name, step, error", [
    ("buildkit-docker20-copy-fail.log", "[3/3] COPY missing.txt /m", 'failed to compute cache key: "/missing.txt" not found'),
    ("classic-other-platform.log", "[4/5] COPY Dockerfile /x", build.OTHER_PLATFORM),
    ("buildkit-docker20-no-base.log", "[internal] load metadata for docker.io/library/nosuch:img", "no such host"),
    ("classic-no-dockerfile.log", None, "unable to prepare context: unable to evaluate symlinks in Dockerfile path"),
])
def test_a_silent_failed_step_or_a_build_failing_before_any_step_names_the_error(name, step, error):
    """A step that fails without output, or a build that fails before any step, names the builder's error."""
    failure = read(name).failure(1)
    assert failure.step == step
    assert failure.output == ()
    assert error in failure.summary()


@pytest.mark.parametrize("name, steps, cached", [
    ("classic-ok.log", 5, 0),
    ("classic-cached.log", 5, 3),
    ("buildkit-docker20-ok.log", 3, 2),
])
def test_a_successful_build_counts_its_dockerfile_steps_and_those_from_the_cache(name, steps, cached):
    log = read(name)
    instructions = [s for s in log.steps.values() if s.instruction]
    assert len(instructions) == steps
    assert sum(s.cached for s in instructions) == cached
    assert not any("Successfully" in line or "writing image" in line for s in instructions for line in s.lines)


def test_a_long_failing_step_shows_its_last_lines_and_counts_the_others():
    log = build_log.BuildLog()
    total = build_log.FAILED_STEP_LINES + 7
    for text in ["Step 1/1 : RUN make", *(f"out {i}" for i in range(total)), "The command '/bin/sh -c make' "
                 "returned a non-zero code: 2"]:
        log.feed(text)
    failure = log.failure(2)
    assert failure.output == tuple(f"out {i}" for i in range(7, total))
    assert failure.omitted == 7 and failure.summary() == "exit code 2"


def test_the_classic_builder_s_early_stderr_is_shown_before_the_step_s_last_lines():
    """The classic builder's stderr that came early is shown before the step's last lines."""
    log = build_log.BuildLog()
    total = build_log.FAILED_STEP_LINES + 7
    # as the classic builder sends them (classic-fail.log): stderr in red, ahead of the stdout before it
    for raw in [b"Step 1/1 : RUN make\n", b"\x1b[91mfatal: widget.c missing\n", b"\x1b[0mout 0\n",
                *(f"out {i}\n".encode() for i in range(1, total)), b"The command '/bin/sh -c make' returned a non-zero code: 2\n"]:
        log.feed(build_log.clean(raw))
    failure = log.failure(2)
    assert failure.output[:2] == ("fatal: widget.c missing", "…")
    assert failure.output[2:] == tuple(f"out {i}" for i in range(total - build_log.FAILED_STEP_LINES + 2, total))
    assert len(failure.output) == build_log.FAILED_STEP_LINES
    assert failure.omitted == total + 1 - (build_log.FAILED_STEP_LINES - 1)


def test_carriage_return_redraws_and_colours_are_dropped_from_a_line():
    assert build_log.clean(b"Sending 1kB\rSending 2kB\r\n") == "Sending 2kB"
    assert build_log.plain(build_log.clean(b"\x1b[91mfatal: widget.c missing\n")) == "fatal: widget.c missing"


# ------------------------------------------------------------------ the command and the platform


def test_the_build_targets_the_platform_with_build_args_and_paths_from_hosts_yaml():
    """The build targets the given platform, with build args and paths relative to hosts.yaml."""
    inv = _inv()
    assert build.build_argv(inv, "linux/arm64") == [
        "docker", "build", "--platform", "linux/arm64", "-t", "t:1", "-f", "/repo/Dockerfile",
        "--build-arg", "BASE_IMAGE=local/cpu-base:1", "/repo"]


def test_the_dry_run_shows_the_platform_read_then_the_build_then_the_image_s_check():
    """The dry run shows the nodes' platform read, then the build with it, then the image's check."""
    lines = prepare.deployer(_inv()).dry_run(build=True)
    assert lines[0] == "[n1] docker version --format '{{.Server.Os}}/{{.Server.Arch}}'"
    built = next(line for line in lines if " build " in line)
    assert built == (f"[local] docker build --platform {build.NODES_PLATFORM} -t t:1 -f /repo/Dockerfile "
                     "--build-arg BASE_IMAGE=local/cpu-base:1 /repo")
    checked = lines.index(next(line for line in lines if "{{.Os}}/{{.Architecture}}" in line))
    assert lines.index(built) < checked
    assert not any(" build " in line for line in prepare.deployer(_inv()).dry_run(build=False))


@pytest.mark.parametrize("said, platform", [
    ("linux/amd64\n", "linux/amd64"), ("Linux x86_64\n", "linux/amd64"), ("Linux aarch64", "linux/arm64"),
    ("Linux armv7l", "linux/arm"), ("Cannot connect to the Docker daemon", None), ("", None),
])
def test_a_node_s_platform_is_read_in_docker_s_names_from_docker_or_uname(said, platform):
    assert platforms.parse_platform(said) == platform


def test_nodes_of_two_platforms_are_refused_naming_each_node_s_platform():
    assert platforms.one_platform({"n1": "linux/amd64", "n2": "linux/amd64"}) == "linux/amd64"
    with pytest.raises(RuntimeFailure) as e:
        platforms.one_platform({"n1": "linux/amd64", "n2": "linux/arm64", "n3": "linux/amd64"})
    line = e.value.lines()[0]
    assert "n1, n3: linux/amd64; n2: linux/arm64" in line and "--without" in line


FAKE_INSPECT = """#!/bin/sh
case "$1 $2" in
  "image inspect") echo linux/arm64 ;;
  "version --format") echo linux/amd64 ;;
  *) exit 99 ;;
esac
"""


@pytest.mark.parametrize("built", [False, True])
def test_an_image_of_another_platform_is_refused_naming_nodes_platforms_and_the_fix(tmp_path, monkeypatch, built):
    """An image of another platform than the nodes' is refused, naming the nodes, both platforms and
    the fix."""
    install_command(tmp_path, monkeypatch, "docker", FAKE_INSPECT)
    with pytest.raises(RuntimeFailure) as e:
        platforms.refuse_other_platform(_inv(), {"n1": "linux/amd64", "n2": "linux/amd64"}, built=built)
    [line] = e.value.lines()
    assert line.startswith("image t:1 is linux/arm64 but n1, n2 are linux/amd64: nothing shipped")
    assert "qemu" in line and "binfmt" in line
    assert ("this machine's docker is linux/amd64" in line) if built else ("drop --no-build" in line)
    assert platforms.refuse_other_platform(_inv(), {"n1": "linux/arm64"}, built=built) == "linux/arm64"


def _platform_rows(runtime, said):
    inv = _inv(runtime, nodes=tuple(said))
    results = {n: {"platform": Result(n, 0 if text else 1, text, "" if text else "no docker")} for n, text in said.items()}
    return {c.node: (c.ok, c.detail) for c in node_checks._platforms(inv, list(said), results)}


def test_check_shows_each_node_s_platform_and_fails_a_docker_node_of_another_one():
    """check shows each node's platform, and fails a Docker node of another platform."""
    rows = _platform_rows("docker", {"n1": "linux/amd64", "n2": "linux/arm64", "n3": "linux/amd64"})
    assert rows["n1"] == (True, "linux/amd64") and rows["n3"] == (True, "linux/amd64")
    assert rows["n2"][0] is False
    assert rows["n2"][1].startswith("linux/arm64, unlike n1's linux/amd64") and "--without n2" in rows["n2"][1]
    assert _platform_rows("host", {"n1": "Linux x86_64", "n2": "Linux aarch64"}) == {
        "n1": (True, "linux/amd64"), "n2": (True, "linux/arm64")}  # each host runs its own interpreter
    assert _platform_rows("docker", {"n1": "", "n2": "linux/amd64"})["n1"][0] is False


def test_check_reads_the_platform_in_the_node_s_one_session():
    inv = _inv()
    argv = preflight.check_argv(inv, inv.node("n1"), "tok")
    at = argv.index("platform")
    assert argv[at + 2:at + 2 + int(argv[at + 1])] == platforms.NODE_PLATFORM_ARGV["docker"]


# ------------------------------------------------------------------ running it

# Prints a captured log line by line; after the line named by $FAKE_PAUSE_AFTER it waits until
# the file $FAKE_GO exists (created by the test's view once it has seen that line: the output is
# read as it comes), then exits $FAKE_EXIT; if the file never comes, it says so and exits 97.
FAKE_BUILD = """#!PYTHON
import json, os, sys, time
open(os.environ["FAKE_ARGS"], "w").write(json.dumps({"argv": sys.argv[1:], "progress": os.environ.get("BUILDKIT_PROGRESS")}))
for line in open(os.environ["FAKE_LOG"], "rb"):
    sys.stdout.buffer.write(line)
    sys.stdout.flush()
    if line.decode().strip() == os.environ.get("FAKE_PAUSE_AFTER"):
        end = time.time() + 10
        while not os.path.exists(os.environ["FAKE_GO"]) and time.time() < end:
            time.sleep(0.02)
        if not os.path.exists(os.environ["FAKE_GO"]):
            print("the output was not read while the build ran")
            sys.exit(97)
sys.exit(int(os.environ["FAKE_EXIT"]))
""".replace("PYTHON", sys.executable)


class RecordingView(build_view.TerminalView):
    def __init__(self, go: Path, after: str):
        super().__init__(Console(file=io.StringIO(), width=200, highlight=False))
        self.go, self.after, self.seen = go, after, []

    def line(self, step, text):
        super().line(step, text)
        self.seen.append(text)
        if text == self.after:
            self.go.touch()

    def printed(self) -> str:
        return self.console.file.getvalue()


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    install_command(tmp_path, monkeypatch, "docker", FAKE_BUILD)
    monkeypatch.setenv("FAKE_ARGS", str(tmp_path / "args.json"))
    monkeypatch.setenv("FAKE_GO", str(tmp_path / "go"))
    monkeypatch.setenv(build.LOG_ENV, str(tmp_path / "logs" / "build.log"))

    def use(log: str, exit_code: int, pause_after: str, seen: str | None = None) -> RecordingView:
        """``seen``: the step output ``pause_after`` gives (itself unless a prefix is dropped)."""
        monkeypatch.setenv("FAKE_LOG", str(LOGS / log))
        monkeypatch.setenv("FAKE_EXIT", str(exit_code))
        monkeypatch.setenv("FAKE_PAUSE_AFTER", pause_after)
        return RecordingView(tmp_path / "go", seen or pause_after)
    return use


def test_a_failed_build_streams_its_output_names_the_failing_step_and_keeps_the_log(fake_build, tmp_path):
    """A failed build streams its output, prints the failing step, and keeps the whole log."""
    # the fake waits after "line 2" until the view has seen it: the output is read as it comes
    view = fake_build("classic-fail.log", 3, "line 2")
    with pytest.raises(RuntimeFailure) as e:
        build.run_build(build.build_argv(_inv(), "linux/amd64"), view, build.log_path())
    [line] = e.value.lines()
    assert line.startswith("docker build failed at [4/5] RUN echo \"compiling widget\"")
    assert ": exit code 3 (its output is above; the whole build log: " in line
    printed = view.printed()
    assert "build failed at [4/5] RUN" in printed and "(exit code 3), its output:" in printed
    assert {text[len("  | "):] for text in printed.splitlines() if text.startswith("  | ")} == WIDGET_OUTPUT
    assert "build [3/5] RUN echo first-step-ok" in printed  # the steps as they started (not a terminal)
    assert "Running in" not in "".join(view.seen) and "first-step-ok" in view.seen  # the steps' own output
    kept = (tmp_path / "logs" / "build.log").read_text()
    assert kept.startswith("$ docker build --platform linux/amd64 ") and "first-step-ok" in kept
    assert "The command '/bin/sh -c" in kept and "\x1b[" not in kept
    args = json.loads((tmp_path / "args.json").read_text())
    assert args["progress"] == "plain"  # BuildKit's plain progress whatever the operator's setting


def test_a_successful_buildkit_build_says_how_long_and_how_much_came_from_the_cache(fake_build, tmp_path):
    view = fake_build("buildkit-docker20-ok.log", 0, "#8 exporting layers done", "exporting layers done")
    log = build.run_build(["docker", "build", "."], view, build.log_path())
    assert log.kind == "buildkit"
    assert "built in " in view.printed() and " by BuildKit: 3 steps, 2 from the cache (log: " in view.printed()


def test_a_build_refused_for_another_platform_says_what_a_cross_build_needs(fake_build):
    view = fake_build("classic-other-platform.log", 1, "hello-two")
    with pytest.raises(RuntimeFailure) as e:
        build.run_build(["docker", "build", "."], view, build.log_path())
    assert "at [4/5] COPY Dockerfile /x" in e.value.lines()[0] and "qemu" in e.value.lines()[0]


def test_on_a_terminal_the_running_step_is_shown_with_only_its_last_lines():
    view = build_view.TerminalView(Console(file=io.StringIO(), force_terminal=True, width=120))
    step = build_log.Step("#6", "[3/4] RUN make")
    view.started(step)
    for i in range(build_view.TAIL_LINES + 3):
        view.line(step, f"out {i}")
    shown = Console(file=io.StringIO(), width=120)
    shown.print(view._render())
    lines = shown.file.getvalue().splitlines()
    assert lines[0].startswith("building [3/4] RUN make")
    assert [line.strip() for line in lines[1:]] == [f"out {i}" for i in range(3, build_view.TAIL_LINES + 3)]


def test_without_docker_here_the_build_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(build.LOG_ENV, str(tmp_path / "build.log"))
    with pytest.raises(RuntimeFailure) as e:
        build.run_build(["docker", "build", "."], build_view.TerminalView(Console(file=io.StringIO())), build.log_path())
    assert "cannot run docker build here" in e.value.lines()[0]
