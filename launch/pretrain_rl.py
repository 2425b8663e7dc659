"""Training entry point.

    python launch/pretrain_rl.py --nproc_per_node N [--config-name NAME] [hydra overrides]   # checks, then torchrun
    python launch/pretrain_rl.py --check --nproc_per_node N [...]                            # the checks only
    torchrun --nproc_per_node N launch/pretrain_rl.py [hydra overrides]                      # a worker per rank

Run with ``python`` (not under torchrun) it is the launcher: it composes the config, runs the pre-flight
(:mod:`mcore_agentic.trainer.preflight`: every problem of the config, its paths, tools, reward function and data,
one ``error: <field>: <fix>`` line each, exit code 2) and only then starts ``--nproc_per_node`` workers with
torchrun (``--standalone``; multi-node jobs start torchrun themselves, see ``slurm/``). It exits with the run's
own code (0, 2, 3, or 75 after a stop signal, which it passes on to the workers), with no torchrun report after
the run's lines unless a worker crashed. ``trainer.n_gpus_per_node`` (a verl script's world size) stands in for a
missing ``--nproc_per_node``. ``--config-path`` /
``--config-dir`` name a directory of your own YAML (relative to the working directory); the shipped configs stay on
Hydra's search path, so your YAML can start from ``defaults: [byo_task, _self_]``. verl's key names are accepted
on the command line and in YAML (one line each names the native key; docs/verl_migration.md).

Under torchrun each worker composes ``configs/default_tiny.yaml`` (the embedded CPU default that ``make train``
runs; ``--config-name <name>`` picks another, e.g. ``gsm8k_multiturn_grpo``) with Hydra, initialises
``torch.distributed`` from the torchrun environment (``cpu:gloo,cuda:nccl`` on GPU, gloo on CPU), applies the
megatron-core CPU patches, runs the pre-flight (unless the launcher just did), creates Megatron's process groups
and hands over to ``mcore_agentic.trainer.run``. A bad config prints its lines on rank 0 and every worker exits
2; torchrun then adds its own ``ChildFailedError`` report (the launcher form avoids that).

A run whose rollouts almost all fail stops after ``trainer.failure_stop_steps`` such steps with one line saying
why and exit code 3 (``trainer.failure_stop_steps=0`` allows it).

A stop signal (``trainer.stop_signals``, default SIGTERM and SIGUSR1) ends the run
after the current step and a checkpoint: rank 0 prints one line ``stopped on
<signal> after step <k>: checkpoint <dir>; ...`` and every rank exits with 75
(``EX_TEMPFAIL``). Running the same command again resumes. Give ``torchrun``
``--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1`` (it forwards them to
the ranks) and a ``--shutdown-timeout`` longer than a step plus a save: it kills
the ranks that long after forwarding (default 30 s). ``torchrun`` itself then
exits 1 with its own ``SignalException`` traceback; the ranks' code is 75.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from mcore_agentic.utils.errors import ConfigError  # noqa: E402

logger = logging.getLogger("launch.pretrain_rl")

EXIT_CONFIG_ERROR = 2
EXIT_RUN_FAILED = 3
CONFIG_DIR = _ROOT / "configs"
PREFLIGHT_ENV = "MCORE_AGENTIC_PREFLIGHT_DONE"
"""Set by the launcher for the workers it starts: the pre-flight's data and plug-in checks already ran."""


# ----------------------------------------------------------------------------------- command line
@dataclass
class LaunchArgs:
    """The command line, split into the launcher's own flags, Hydra's config selection and the overrides."""

    nproc_per_node: int = 1
    nproc_given: bool = False
    nnodes: int = 1
    check: bool = False
    config_name: str | None = None
    config_dir: Path | None = None
    overrides: list[str] = field(default_factory=list)
    hydra_flags: list[str] = field(default_factory=list)

    def hydra_argv(self) -> list[str]:
        """Hydra's command line for the workers: an absolute config directory (the shipped configs stay on the
        search path), the config name, the overrides."""
        argv = list(self.hydra_flags)
        if self.config_dir is not None:
            argv += ["--config-path", str(self.config_dir)]
            if not any(o.split("=", 1)[0].lstrip("+") == "hydra.searchpath" for o in self.overrides):
                argv.append(f"hydra.searchpath=[file://{CONFIG_DIR}]")
        if self.config_name is not None:
            argv += ["--config-name", self.config_name]
        return argv + self.overrides


_VALUE_FLAGS = {
    "--nproc_per_node": "nproc_per_node", "--nproc-per-node": "nproc_per_node", "--nnodes": "nnodes",
    "--config-name": "config_name", "-cn": "config_name",
    "--config-path": "config_dir", "-cp": "config_dir", "--config-dir": "config_dir", "-cd": "config_dir",
}


def parse_args(argv: list[str]) -> LaunchArgs:
    """:class:`LaunchArgs` of ``argv`` (``--flag value`` and ``--flag=value`` both work)."""
    args = LaunchArgs()
    i = 0
    while i < len(argv):
        item = argv[i]
        name, eq, inline = item.partition("=")
        if item == "--check":
            args.check = True
        elif name in _VALUE_FLAGS and item.startswith("-"):
            if eq:
                value = inline
            else:
                if i + 1 >= len(argv):
                    raise ConfigError(name, "needs a value")
                i += 1
                value = argv[i]
            attr = _VALUE_FLAGS[name]
            if attr in ("nproc_per_node", "nnodes"):
                if not value.isdigit() or int(value) < 1:
                    raise ConfigError(name, f"must be a positive integer, got {value!r}")
                setattr(args, attr, int(value))
                args.nproc_given = args.nproc_given or attr == "nproc_per_node"
            elif attr == "config_dir":
                args.config_dir = Path(value).expanduser().resolve()
            else:
                args.config_name = value
        elif item.startswith("-"):
            args.hydra_flags.append(item)
        else:
            args.overrides.append(item)
        i += 1
    return args


# ----------------------------------------------------------------------------------- pre-flight
def user_config_dirs(config_dir: str | os.PathLike | None) -> list[Path]:
    """The user's own config directory (not the shipped ``configs/``), for relative input paths."""
    if config_dir is None:
        return []
    path = Path(config_dir).resolve()
    return [] if path == CONFIG_DIR.resolve() else [path]


def compose_config(args: LaunchArgs) -> DictConfig:
    """The composed Hydra config of ``args``, as the workers will compose it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from mcore_agentic.trainer.config import log_dir_of

    OmegaConf.register_new_resolver("log_dir", log_dir_of, replace=True)
    directory = args.config_dir or CONFIG_DIR
    overrides = list(args.overrides)
    if args.config_dir is not None and not any(o.split("=", 1)[0].lstrip("+") == "hydra.searchpath" for o in overrides):
        overrides.append(f"hydra.searchpath=[file://{CONFIG_DIR}]")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(directory), version_base=None):
            return compose(config_name=args.config_name or "default_tiny", overrides=overrides)
    except Exception as exc:  # noqa: BLE001 -- Hydra's composition errors: one line naming the config
        from mcore_agentic.utils.errors import first_line

        raise ConfigError(f"--config-name {args.config_name or 'default_tiny'}",
                          f"{first_line(exc)} (config directory {directory})") from None


def report(problems: list[ConfigError]) -> None:
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr, flush=True)


def preflight_launch(args: LaunchArgs) -> int:
    """The launcher: translate verl keys, compose, pre-flight; then exit (``--check`` or a problem) or run the workers."""
    from mcore_agentic.config import check_overrides, load_config
    from mcore_agentic.config.paths import search_dirs
    from mcore_agentic.trainer.preflight import preflight

    said = logging.StreamHandler(sys.stderr)  # verl keys found in YAML files: one line each, as on the command line
    said.setFormatter(logging.Formatter("%(message)s"))
    config_log = logging.getLogger("mcore_agentic.config.load")
    config_log.addHandler(said)
    config_log.setLevel(logging.INFO)
    problems: list[ConfigError] = []
    verl_gpus = [o.split("=", 1)[1] for o in args.overrides if o.lstrip("+").startswith("trainer.n_gpus_per_node=")]
    if verl_gpus and verl_gpus[-1].isdigit():
        if not args.nproc_given:  # a verl script sets the world size here; --nproc_per_node does it in this launcher
            args.nproc_per_node = int(verl_gpus[-1])
        elif args.nproc_per_node != int(verl_gpus[-1]):
            problems.append(ConfigError("trainer.n_gpus_per_node", f"={verl_gpus[-1]} but --nproc_per_node "
                                        f"{args.nproc_per_node}: drop one (--nproc_per_node sets the world size)"))
    try:
        args.overrides = translate(args.overrides)
    except ConfigError as exc:
        report(getattr(exc, "errors", None) or [exc])
        return EXIT_CONFIG_ERROR
    try:
        check_overrides([a for a in args.overrides if not a.startswith("hydra.")])
    except ConfigError as exc:  # say them with everything else; compose without them
        bad = getattr(exc, "errors", None) or [exc]
        problems += bad
        unknown = {e.field for e in bad}
        args.overrides = [o for o in args.overrides if o.split("=", 1)[0].lstrip("+~") not in unknown]
    dirs = search_dirs(user_config_dirs(args.config_dir))
    world = args.nproc_per_node * args.nnodes
    try:
        cfg = load_config(compose_config(args), overrides=args.overrides, search_dirs=dirs)
    except ConfigError as exc:
        problems += getattr(exc, "errors", None) or [exc]
    else:
        problems += preflight(cfg, world, local_world_size=args.nproc_per_node, dirs=dirs)
        if not problems:  # before any model is built: will it fit?
            problems += plan_check(cfg, world)
    if problems:
        report(problems)
        return EXIT_CONFIG_ERROR
    if args.check:
        print(f"pre-flight passed: {args.config_name or 'default_tiny'} on {world} rank(s)", flush=True)
        return 0
    if args.nnodes > 1:
        report([ConfigError("--nnodes", "the launcher starts one node; multi-node jobs run torchrun on every node "
                             "(slurm/train_multinode.sh), after `--check --nnodes N`")])
        return EXIT_CONFIG_ERROR
    return run_workers(args)


def plan_check(cfg: Any, world: int, *, say: bool = True) -> list[ConfigError]:
    """``trainer.plan_check`` on this machine's GPUs (nothing on CPU): a line (printed when ``say``), or the refusal
    of a run that does not fit (``error``). Runs only once the config passed its pre-flight."""
    from mcore_agentic.plan.check import launch_check, local_gpu

    try:
        line, error = launch_check(cfg, world, local_gpu() if cfg.trainer.device != "cpu" else None)
    except ConfigError as exc:  # a model the planner cannot read: say so, do not stop a run it would not stop
        if say:
            print(f"plan: skipped ({exc})", file=sys.stderr, flush=True)
        return []
    except Exception as exc:  # noqa: BLE001 -- the planner itself failed (e.g. its census child died)
        return planner_failed(cfg.trainer.plan_check, exc, say=say)
    if line and say:
        print(line, file=sys.stderr, flush=True)
    return [error] if error is not None else []


def planner_failed(mode: str, exc: Exception, *, say: bool = True) -> list[ConfigError]:
    """A planner that failed: ``trainer.plan_check=error`` stops the run in one line; ``warn`` says one and goes on."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    what = type(exc).__name__ + (f": {lines[0]}" if lines else "") + (f" ... {lines[-1]}" if len(lines) > 1 else "")
    if mode == "error":
        return [ConfigError("trainer.plan_check", f"the planner failed ({what}); trainer.plan_check=warn runs "
                                                  "without its verdict")]
    if say:
        print(f"plan: WARNING, skipped: the planner failed ({what}); the run goes on", file=sys.stderr, flush=True)
    return []


STOP_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1")


def run_workers(args: LaunchArgs) -> int:
    """Start the workers under torchrun and return the run's own exit code.

    torchrun reports a worker's non-zero exit with a ``ChildFailedError`` trailer and exits 1 whatever the code.
    So the workers this launcher starts record their exit code (0, 2 a config error, 3 a run that trained on
    nothing, 75 stopped by a signal) in a file and exit 0; this process exits with that code, after nothing but
    the run's own lines. A worker that crashes still exits non-zero, and torchrun's report (its traceback) follows.
    A stop signal sent to this process goes to the workers themselves (torchrun would answer it with a traceback of
    its own): they finish the step, save and record 75. Ctrl-C reaches every process of the terminal's group.
    """
    import signal
    import subprocess
    import tempfile

    import psutil

    proc: subprocess.Popen | None = None
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if proc is None:
            pending.append(signum)
            return
        try:
            workers = psutil.Process(proc.pid).children(recursive=False)
        except psutil.NoSuchProcess:
            return
        for worker in workers:
            try:
                worker.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), forward)
    with tempfile.TemporaryDirectory(prefix="mcore_agentic_exit_") as tmp:
        exit_file = Path(tmp) / "code"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(args.nproc_per_node), str(Path(__file__).resolve()), *args.hydra_argv()]
        env = {**os.environ, PREFLIGHT_ENV: "1", EXIT_FILE_ENV: str(exit_file)}
        env.setdefault("OMP_NUM_THREADS", "1")
        sys.stdout.flush()
        sys.stderr.flush()
        proc = subprocess.Popen(argv, env=env)
        signal.signal(signal.SIGINT, lambda *_: None)  # the group's Ctrl-C is torchrun's and the workers' to handle
        if pending:  # a stop signal before the workers existed: they get it once they do
            time.sleep(1.0)
            forward(pending[0], None)
        rc = proc.wait()
        recorded = {int(c.name.rsplit("rank", 1)[1]): c.read_text().strip() for c in Path(tmp).glob("code.rank*")}
        if len(recorded) == args.nproc_per_node:  # every worker ended through the launcher's path: its code
            return next((int(recorded[r]) for r in sorted(recorded) if recorded[r] not in ("", "0")), 0)
        return rc if rc >= 0 else 128 - rc  # a worker crashed (torchrun's report says which), or torchrun was killed


EXIT_FILE_ENV = "MCORE_AGENTIC_EXIT_FILE"
"""Set by the launcher for its workers: each records its exit code in ``<file>.rank<r>`` and exits 0."""


def translate(overrides: list[str]) -> list[str]:
    """Command-line overrides with verl's key names rewritten to the native ones (one line each, once)."""
    from mcore_agentic.config.load import translate_overrides

    rewritten, lines = translate_overrides(overrides)
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    return rewritten


# ----------------------------------------------------------------------------------- workers
def hydra_config_dirs() -> list[Path]:
    """The user's config directories of the running Hydra job (empty outside one)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        sources = HydraConfig.get().runtime.config_sources
    except Exception:  # noqa: BLE001 -- not inside @hydra.main (tests call launch() directly)
        return []
    dirs = []
    for source in sources:
        if source.schema == "file" and Path(source.path).resolve() != CONFIG_DIR.resolve():
            dirs.append(Path(source.path))
    return dirs


def check_config(cfg: Any, world_size: int, dirs: list[Path] | None = None) -> None:
    """Every rule that can run before any process group exists; raises one :class:`ConfigError` with them all.

    ``dirs``: where relative input paths were looked up (default: the working directory, then the repository)."""
    from mcore_agentic.config.paths import search_dirs
    from mcore_agentic.trainer.preflight import preflight
    from mcore_agentic.utils.errors import ConfigErrors

    dirs = dirs if dirs is not None else search_dirs()
    launched = os.environ.get(PREFLIGHT_ENV) == "1"  # the python launcher checked everything (and planned) already
    problems = preflight(cfg, world_size, local_world_size=_local_world_size(world_size), dirs=dirs, light=launched)
    if not problems and not launched:  # torchrun or Slurm directly: every rank plans (the same verdict), rank 0 says it
        say = int(os.environ.get("JOB_RANK", os.environ.get("RANK", "0"))) == 0
        problems += plan_check(cfg, world_size, say=say)  # the job's GPUs: the plan splits them as the run does
    if problems:
        raise ConfigErrors(problems)


def _local_world_size(world_size: int) -> int:
    from mcore_agentic.parallel.layout import local_world_size

    return local_world_size(world_size)


def launch(dict_cfg: DictConfig) -> int:
    """Run one job from a composed Hydra config; returns the process exit code."""
    import torch.distributed as dist

    from mcore_agentic.config import load_config
    from mcore_agentic.config.paths import search_dirs
    from mcore_agentic.parallel.job import RolloutRankFailed
    from mcore_agentic.parallel.layout import destroy_parallel, init_distributed, initialize_parallel, select_device
    from mcore_agentic.trainer.preemption import EXIT_PREEMPTED, TrainingStopped
    from mcore_agentic.trainer.run_health import RunFailed

    rank = int(os.environ.get("RANK", "0"))
    try:
        dirs = search_dirs(hydra_config_dirs())
        # The launcher said the verl keys already; torchrun's workers alone say them on rank 0.
        cfg = load_config(dict_cfg, search_dirs=dirs, log_aliases=rank == 0 and os.environ.get(PREFLIGHT_ENV) != "1")
        select_device(cfg.trainer.device)  # before anything initialises CUDA
        from mcore_agentic.models.transformer_impl import use_te_for

        use_te_for(cfg.model.transformer_impl)  # TE asked for but missing: one line, before megatron is imported
        if cfg.rollout.separate:  # the job's last rollout.rollout_ranks generate, the others train
            from mcore_agentic.parallel.job import init_job, split_from_env

            split = split_from_env(cfg.rollout.rollout_ranks, cfg.rollout.tensor_model_parallel_size)
            init_job(split, cfg.trainer.dist_timeout_minutes)
            rank, job_world = split.rank, split.world_size
        else:
            split = None
            init_distributed(cfg.trainer.dist_timeout_minutes)
            rank, job_world = dist.get_rank(), dist.get_world_size()
        check_config(cfg, job_world, dirs)  # before importing megatron: a bad config fails fast and quietly
        from mcore_agentic.trainer import run

        if split is not None and split.is_rollout:
            run(cfg)  # no Megatron on a rollout rank
        else:
            import megatron_patches

            megatron_patches.apply()
            run(cfg, layout=initialize_parallel(cfg.actor.parallel, cfg.seed))
    except ConfigError as exc:
        if rank == 0:
            report(getattr(exc, "errors", None) or [exc])
        _let_rank0_report(rank)
        _shutdown(destroy_parallel)
        return EXIT_CONFIG_ERROR
    except TrainingStopped as exc:
        if rank == 0:
            print(str(exc), file=sys.stderr, flush=True)
        _shutdown(destroy_parallel)
        return EXIT_PREEMPTED
    except (RunFailed, RolloutRankFailed) as exc:  # the run stopped itself, or a rollout rank failed: one line
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        _let_rank0_report(rank)
        _shutdown(destroy_parallel)
        return EXIT_RUN_FAILED
    _shutdown(destroy_parallel)
    return 0


def _let_rank0_report(rank: int, timeout_s: float = 10.0) -> None:
    """Hold the other ranks' exit until rank 0 has printed its error line: torchrun stops every rank as soon as
    one exits, and a rank 0 a moment behind would be killed before it says what is wrong. Bounded: an error
    that rank 0 never reaches costs the others ``timeout_s``, never a hang."""
    import datetime
    import time

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # a single process, nothing to wait for
        return
    deadline = time.monotonic() + timeout_s
    key = f"mcore_agentic/error_reported/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = _job_store(timeout_s)
    try:
        if rank == 0:
            if store is not None:
                store.set(key, "1")
            return
        if store is not None:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
            return
    except Exception:  # noqa: BLE001 -- the store failed us: fall back to waiting out the bound below
        pass
    # No store to wait on (or it raised at once; seen on a loaded CI machine, where this rank then exited before
    # rank 0 printed and torchrun killed it): wait out the bound. Rank 0's exit ends this wait early, as torchrun
    # then stops this rank.
    time.sleep(max(0.0, deadline - time.monotonic()))


def _job_store(timeout_s: float) -> Any:
    """The job's key-value store: the process group's once it is up; before that (a config error found while
    loading the config) a client of the store torchrun's agent serves at ``MASTER_ADDR:MASTER_PORT``."""
    import torch.distributed as dist

    from mcore_agentic.parallel.job import job_store

    try:
        if dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 -- no store reachable: exit without waiting
        return None
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return job_store(timeout_s)
    return None


def _shutdown(destroy_parallel: Any) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        destroy_parallel(destroy_process_group=True)


@hydra.main(config_path="../configs", config_name="default_tiny", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    code = launch(dict_cfg)
    exit_file = os.environ.get(EXIT_FILE_ENV)
    if exit_file:  # started by the launcher: it exits with the code, so torchrun adds no failure report
        Path(f"{exit_file}.rank{os.environ.get('RANK', '0')}").write_text(str(code))
        return
    if code:
        sys.exit(code)


# Hydra's own files (its log, per rank) go to the run's log directory instead of a new
# outputs/<date>/<time>/ in the working directory on every launch; a command line that sets
# hydra.run.dir or the log file keeps its own.
HYDRA_DEFAULTS = (
    "hydra.run.dir='${log_dir:${trainer.log_dir},${trainer.project_name},${trainer.experiment_name}}'",
    "hydra.output_subdir=null",
    "hydra.job_logging.handlers.file.filename='${hydra.runtime.output_dir}/launch_rank${oc.env:RANK,0}.log'",
)


def with_hydra_defaults(argv: list[str]) -> list[str]:
    """``argv`` plus :data:`HYDRA_DEFAULTS` for every key it does not set itself."""
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a}
    return argv + [d for d in HYDRA_DEFAULTS if d.split("=", 1)[0] not in given]


def under_torchrun() -> bool:
    """A worker (torchrun, srun or a test sets the rank's environment) rather than the launcher."""
    return "LOCAL_RANK" in os.environ or "RANK" in os.environ


def worker_main() -> None:
    from mcore_agentic.config import check_overrides

    rank0 = os.environ.get("RANK", "0") == "0"
    try:  # Hydra alone says "Key 'x' is not in struct"; name the nearest real key instead
        args = parse_args(sys.argv[1:])
        args.overrides = translate(args.overrides) if rank0 else _translate_quietly(args.overrides)
        check_overrides([a for a in args.overrides if not a.startswith("hydra.")])
    except ConfigError as exc:
        if rank0:
            report(getattr(exc, "errors", None) or [exc])
        exit_file = os.environ.get(EXIT_FILE_ENV)
        if exit_file:
            Path(f"{exit_file}.rank{os.environ.get('RANK', '0')}").write_text(str(EXIT_CONFIG_ERROR))
            sys.exit(0)
        # Under a bare torchrun, a rank that exits first gets the others killed: rank 0 must have said it first
        # (this path missed it, and on a loaded machine rank 1's exit killed rank 0 before its line).
        _let_rank0_report(int(os.environ.get("RANK", "0")))
        sys.exit(EXIT_CONFIG_ERROR)
    from omegaconf import OmegaConf

    from mcore_agentic.trainer.config import log_dir_of

    OmegaConf.register_new_resolver("log_dir", log_dir_of, replace=True)
    sys.argv = [sys.argv[0], *with_hydra_defaults(args.hydra_argv())]
    main()


def _translate_quietly(overrides: list[str]) -> list[str]:
    from mcore_agentic.config.load import translate_overrides

    return translate_overrides(overrides)[0]


if __name__ == "__main__":
    if under_torchrun():
        worker_main()
    else:
        try:
            launch_args = parse_args(sys.argv[1:])
        except ConfigError as exc:
            report([exc])
            sys.exit(EXIT_CONFIG_ERROR)
        sys.exit(preflight_launch(launch_args))
