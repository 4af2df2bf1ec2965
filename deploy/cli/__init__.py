"""ddp-deploy: one small command per verb. This package is the only one that prints: it parses,
calls the engines' verbs (engine.py, picked by choose.py) and renders what they return (render.py,
table.py, build_view.py); nothing below it imports click or rich.

Library errors become one line per problem on stderr and an exit code (2: bad input,
1: a node failed, 3: the job that ``launch --wait`` or ``status --follow`` followed was ended by
``ddp-deploy stop``); the full traceback goes only to the debug log (``DDP_DEPLOY_LOG``,
default ``~/.cache/ddp-deploy/debug.log``).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import DeployError, InputError
from ..job import secretenv
from ..text import safe

if TYPE_CHECKING:
    from ..inventory import Inventory
    from .engine import Engine

log = logging.getLogger("deploy")


def _log_path() -> Path:
    return Path(os.environ.get("DDP_DEPLOY_LOG", Path.home() / ".cache" / "ddp-deploy" / "debug.log"))


def _setup_logging(verbose: bool) -> None:
    root = logging.getLogger("deploy")
    root.setLevel(logging.DEBUG)
    for h in list(root.handlers):
        root.removeHandler(h)
    try:
        path = _log_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(path)
        fh.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"))
        root.addHandler(fh)
    except OSError:
        pass
    if verbose:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(logging.Formatter("debug: %(message)s"))
        root.addHandler(sh)


class _Group(click.Group):
    """Turns library errors into one-line messages and exit codes."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DeployError as e:
            log.debug("failed", exc_info=True)
            redact = ctx.obj.redact if isinstance(ctx.obj, _State) else str
            for line in e.lines():  # they may quote the job's output: shown as text
                click.echo(safe(redact(f"{e.label}: {line}")), err=True)
            raise click.exceptions.Exit(e.exit_code) from None
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            raise click.exceptions.Exit(130) from None
        except Exception as e:
            log.exception("internal error")
            click.echo(safe(f"error: internal error: {type(e).__name__}: {e} (traceback in {_log_path()})"), err=True)
            raise click.exceptions.Exit(1) from None


class _State:
    def __init__(self, hosts: str, without: tuple[str, ...] = (), spares: tuple[str, ...] = ()) -> None:
        self.hosts = hosts
        self.without, self.spares = without, spares
        self._inv: Inventory | None = None
        self._redactor = secretenv.Redactor()

    @property
    def inv(self) -> Inventory:
        if self._inv is None:
            from ..inventory import load  # pydantic and yaml: only for a verb that reads hosts.yaml

            inv = load(self.hosts)
            if self.without:
                inv = self._without(inv)
            if self.spares:
                inv = inv.with_spares(self.spares)
                click.echo(f"note: with {', '.join(self.spares)} in place of what is left out: {len(inv.nodes)} nodes",
                           err=True)
            self._inv = inv
            self.use_redactor(secretenv.redactor_for(self._inv))
        return self._inv

    def _without(self, whole: Inventory) -> Inventory:
        inv = whole.without(self.without)
        moved = "" if inv.rendezvous.node == whole.rendezvous.node else (
            f"; the rendezvous moves from {whole.rendezvous.node} to {inv.rdzv_node.name} "
            f"({inv.rdzv_node.address}:{inv.rendezvous.port})")
        click.echo(f"note: without {', '.join(self.without)}: {len(inv.nodes)} nodes{moved}", err=True)
        return inv

    def use_redactor(self, redactor: secretenv.Redactor) -> None:
        """Every secret value this shell can read is shown as *** in output and the debug log."""
        self._redactor = redactor
        if redactor:
            for h in logging.getLogger("deploy").handlers:
                h.addFilter(redactor.logging_filter())

    def redact(self, text: str) -> str:
        return self._redactor(text)

    @property
    def engine(self) -> Engine:
        """The engine that runs this inventory's job (deploy/cli/choose.py), bound to this invocation."""
        from . import choose  # the engines, and what they import, only for a verb that runs (not --help)

        return choose.for_invocation(self)


pass_state = click.make_pass_decorator(_State)


dry_run_option = click.option("--dry-run", is_flag=True, help="Print the per-node commands; touch nothing.")
wait_lock_option = click.option("--wait-lock", type=click.FloatRange(min=0), default=0, metavar="SECONDS",
                                help="Where another command of this job holds its lock, wait up to SECONDS for it "
                                     "to finish instead of refusing (a stale lock is refused at once).")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="Exit codes: 0 done; 1 a node or the job failed; 2 bad input (nothing was touched); "
                    "3 the job that launch --wait or status --follow followed was stopped by `ddp-deploy stop`.")
@click.option("--hosts", default="hosts.yaml", envvar="DDP_HOSTS", show_default=True,
              help="Inventory file (env DDP_HOSTS).")
@click.option("--without", metavar="NODE", multiple=True,
              help="Leave this node out (lost for good), repeatable: the job runs on the others, and if it "
                   "hosted the rendezvous, the first remaining node does. hosts.yaml is not changed.")
@click.option("--with", "spares", metavar="SPARE", multiple=True,
              help="Put this spare (hosts.yaml's spares:) in the job, repeatable: each in the place of a node "
                   "left out with --without.")
@click.option("-v", "--verbose", is_flag=True, help="Debug output on stderr.")
@click.pass_context
def cli(ctx: click.Context, hosts: str, without: tuple[str, ...], spares: tuple[str, ...], verbose: bool) -> None:
    """Deploy and run multi-node PyTorch DDP training described by hosts.yaml."""
    _setup_logging(verbose)
    ctx.obj = _State(hosts, *(tuple(n for item in given for n in item.split(",") if n) for given in (without, spares)))


@cli.command()
@pass_state
def validate(st: _State) -> None:
    """Parse and validate hosts.yaml only (no connection)."""
    st.engine.validate()


@cli.command()
@click.option("--network", is_flag=True,
              help="Then a short all-reduce across every node with the job's backend, image and interfaces.")
@click.option("--network-mb", type=click.FloatRange(min=0.001), default=32, show_default=True,
              help="With --network: the all-reduce buffer, in MiB.")
@pass_state
def check(st: _State, network: bool, network_mb: float) -> None:
    """Preflight checks on every node, in parallel (with train.code: the code is synced first, so
    that the program's import is checked where it will run)."""
    st.engine.check(network, network_mb)


@cli.command()
@dry_run_option
@click.option("--build/--no-build", default=True, help="Build the image here first (docker runtime).")
@wait_lock_option
@pass_state
def deploy(st: _State, dry_run: bool, build: bool, wait_lock: float) -> None:
    """Create the shared directories; get the image (docker) or check the interpreter (host)."""
    st.engine.deploy(dry_run, build, wait_lock)


cli.add_command(deploy, name="sync")


@cli.command()
@dry_run_option
@click.option("--wait", is_flag=True,
              help="Follow until the job ends on every node; exit 0: it finished and trained, 1: it failed (or "
                   "exited 0 with nothing showing that it trained), 3: `ddp-deploy stop` ended it.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after this many seconds.")
@wait_lock_option
@pass_state
def launch(st: _State, dry_run: bool, wait: bool, timeout: float | None, wait_lock: float) -> None:
    """Start the job on every node (all or nothing)."""
    st.engine.launch(dry_run, wait, timeout, wait_lock)


@cli.command()
@click.argument("node")
@dry_run_option
@pass_state
def join(st: _State, node: str, dry_run: bool) -> None:
    """Start NODE in the elastic job running on the other nodes (job.min_nodes): a node back after
    a loss, one whose restarts ran out, or a spare left out with --without. The running nodes take
    it in at their next rendezvous round, from the newest checkpoint."""
    st.engine.join(node, dry_run)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("-f", "--follow", is_flag=True,
              help="Keep showing it until the job ends (exit code as launch --wait: 0, 1, or 3 when stopped).")
@click.option("--run", "run_id", metavar="ID", help="A kept run instead (`ddp-deploy runs`; the start of its id is "
                                                   "enough): how each node ended, its last metrics, the first failure.")
@pass_state
def status(st: _State, as_json: bool, follow: bool, run_id: str | None) -> None:
    """Every node's state (restarts, exit code) and progress: epoch, step, loss, accuracy,
    samples/s and ETA, from the program's last METRICS line. Each state is explained in
    docs/failures.md, "What status shows"."""
    st.engine.status(as_json, follow, run_id)


@cli.command(name="doctor")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_state
def doctor_(st: _State, as_json: bool) -> None:
    """What every rank of the running job is doing: its Python stack (py-spy), grouped by where
    the ranks wait, the ones holding the others up named first (a hung job: docs/failures.md, "When a job hangs")."""
    st.engine.doctor(as_json)


@cli.command()
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (one Ctrl-C ends it).")
@click.option("-n", "--tail", type=click.IntRange(min=0), default=None, help="Last N lines per node.")
@click.option("--node", "only_nodes", metavar="NAME", multiple=True, help="Only this node's lines (repeatable).")
@click.option("--rank", "only_ranks", metavar="N", type=click.IntRange(min=0), multiple=True,
              help="Only this global rank's lines (repeatable); torchrun's own lines carry no rank.")
@click.option("--run", "run_id", metavar="ID", help="A kept run's logs (`ddp-deploy runs`; the start of its id is "
                                                   "enough), read from the shared volume.")
@pass_state
def logs(st: _State, follow: bool, tail: int | None, only_nodes: tuple[str, ...], only_ranks: tuple[int, ...],
         run_id: str | None) -> None:
    """Every node's output, each line prefixed with the node and the rank that printed it."""
    st.engine.logs(follow, tail, only_nodes, only_ranks, run_id)


@cli.command(name="runs")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, with each run's whole record.")
@pass_state
def runs_(st: _State, as_json: bool) -> None:
    """The job's kept runs, oldest first: id, start, duration, nodes, program, code snapshot,
    image and how they ended (`logs --run ID`, `status --run ID` read one; job.keep_runs
    says how many are kept)."""
    st.engine.runs(as_json)




@cli.command()
@click.option("--run", "run_ids", metavar="ID", multiple=True,
              help="Only this run (repeatable: overlaid; the start of its id is enough). Default: every run.")
@click.option("-o", "--output", metavar="FILE", default=None, help="The PNG to write [default: JOB-metrics.png].")
@pass_state
def plot(st: _State, run_ids: tuple[str, ...], output: str | None) -> None:
    """A PNG of the job's loss, accuracy and samples/s against the step, one colour per run, from
    the built-in trainer's metrics.jsonl on the shared volume (TensorBoard reads the event files
    beside it: tensorboard --logdir CHECKPOINTS/tensorboard). A run of any other program is drawn
    from the METRICS lines of its kept logs: every numeric field against the step."""
    st.engine.plot(run_ids, output)


@cli.command()
@dry_run_option
@click.option("--now", is_flag=True, help="Kill at once: no checkpoint, the work since the last one is redone.")
@pass_state
def stop(st: _State, dry_run: bool, now: bool) -> None:
    """End the job on every reachable node (idempotent). The job first gets SIGTERM and up to
    45 s to finish its step and write a checkpoint, so a later launch redoes nothing."""
    st.engine.stop(dry_run, now)


@cli.command()
@click.argument("target", type=click.Choice(["slurm", "k8s"]))
@click.option("--kind", type=click.Choice(["job", "pytorchjob"]), default="job", show_default=True,
              help="k8s: an indexed Job with a headless Service, or Kubeflow's PyTorchJob.")
@click.option("--namespace", default=None, help="k8s: the namespace of every object.")
@click.option("--pvc", metavar="CLAIM", default=None,
              help="k8s: a PersistentVolumeClaim holding data/ and checkpoints/ (default: the storage host paths).")
@click.option("--image", "image_ref", metavar="REF", default=None,
              help="k8s: the image the cluster pulls (default: image.name).")
@click.option("-o", "--output", metavar="FILE", default=None, help="Write it to FILE instead of stdout.")
@pass_state
def export(st: _State, target: str, kind: str, namespace: str | None, pvc: str | None, image_ref: str | None,
           output: str | None) -> None:
    """Print the job for another engine: the exact Slurm batch script `launch` submits (hosts.yaml
    with slurm:), or Kubernetes manifests (any hosts.yaml). Secrets are named, never included."""
    st.engine.export(target, kind, namespace, pvc, image_ref, output)


@cli.command()
@click.option("--run", "run_id", metavar="ID", default=None,
              help="The run to watch (default: the job's current one, as its launch record says).")
@click.option("--detach", is_flag=True,
              help="Run in the background, in a session of its own: a closed terminal does not end it; its "
                   "output goes to a log (the path is printed).")
@pass_state
def watch(st: _State, run_id: str | None, detach: bool) -> None:
    """Heal the running job without you (hosts.yaml's heal.watch; `launch` starts one by itself): a
    node unreachable for heal.lost_after seconds is left out, a spare put in its place, and the job
    launched again from its newest checkpoint, until it ends. `status` shows what it does, `runs`
    what it did, `stop` ends it with the job (docs/failures.md, "A job that heals itself")."""
    st.engine.watch(run_id, detach)


@cli.command()
@click.option("--force", is_flag=True,
              help="Also remove a live lock (fresh heartbeat): only when you know its command no longer runs.")
@pass_state
def unlock(st: _State, force: bool) -> None:
    """Remove this job's locks, which launch, join and deploy hold, on every reachable node: a stale
    one (its command has ended), or a live one with --force."""
    st.engine.unlock(force)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_state
def jobs(st: _State, as_json: bool) -> None:
    """Every job running on the inventory's nodes, whoever started it: its name, run, user, nodes,
    GPUs and since when, as each node's kernel says, and its state and newest step as its launchers tell
    them (the jobs this tool launched, of any user)."""
    st.engine.jobs(as_json)


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="ddp-deploy")


__all__ = ["cli", "main", "InputError"]
