"""Training entry point: ``torchrun --nproc_per_node N launch/pretrain_rl.py [hydra overrides]``.

Composes ``configs/default_tiny.yaml`` (the embedded CPU default that ``make train`` runs;
``--config-name <name>`` picks another, e.g. ``gsm8k_multiturn_grpo``) with Hydra, initialises ``torch.distributed``
from the torchrun environment (nccl on GPU, gloo on CPU), applies the
megatron-core CPU patches, validates the parallel sizes against the world size
and the model's Hugging Face ``config.json`` (``model.model_path``), creates
Megatron's process groups and hands over to ``mcore_agentic.trainer.run``.

A bad config prints one line ``error: <field>: <fix>`` (rank 0) and exits with
code 2, no traceback. (Under torchrun the launcher's own exit status is then
reported by torchrun as the worker's ``exitcode: 2``; torchrun itself exits 1.)

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
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from mcore_agentic.config.errors import ConfigError  # noqa: E402

logger = logging.getLogger("launch.pretrain_rl")

EXIT_CONFIG_ERROR = 2


def model_shape(model_path: str | os.PathLike) -> dict[str, Any] | None:
    """Heads, KV heads and layers from the HF ``config.json`` at ``model_path`` (None if there is none yet).

    Read with ``transformers.AutoConfig`` from local files only (never the network).
    """
    path = Path(model_path)
    if not (path / "config.json").is_file():
        return None
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError("model.model_path", f"{path}/config.json cannot be read by transformers ({exc})") from None
    heads = hf.num_attention_heads
    return {
        "num_attention_heads": heads,
        "num_query_groups": getattr(hf, "num_key_value_heads", None) or heads,
        "num_layers": hf.num_hidden_layers,
        "num_experts": int(getattr(hf, "num_experts", 0) or 0),
    }


def check_config(cfg: Any, world_size: int) -> None:
    """Every rule that can run before any process group exists (raise :class:`ConfigError`)."""
    from mcore_agentic.config.rules import validate
    from mcore_agentic.parallel.layout import check_cpu_support, local_world_size

    # model_shape is None before the trainer makes the tiny preset: the split is checked when it exists
    validate(cfg, world_size, model_shape=model_shape(cfg.model.model_path), local_world_size=local_world_size(world_size))
    check_cpu_support(cfg.actor.parallel, field_prefix="actor")


def launch(dict_cfg: DictConfig) -> int:
    """Run one job from a composed Hydra config; returns the process exit code."""
    import torch.distributed as dist

    from mcore_agentic.config import load_config
    from mcore_agentic.parallel.layout import destroy_parallel, init_distributed, initialize_parallel, select_device
    from mcore_agentic.trainer.preemption import EXIT_PREEMPTED, TrainingStopped

    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(dict_cfg)
        select_device(cfg.trainer.device)  # before anything initialises CUDA
        from mcore_agentic.models.transformer_impl import use_te_for

        use_te_for(cfg.model.transformer_impl)  # TE asked for but missing: one line, before megatron is imported
        init_distributed(cfg.trainer.dist_timeout_minutes)
        rank = dist.get_rank()
        check_config(cfg, dist.get_world_size())  # before importing megatron: a bad config fails fast and quietly
        import megatron_patches

        megatron_patches.apply()
        layout = initialize_parallel(cfg.actor.parallel, cfg.seed)
        from mcore_agentic.trainer import run

        run(cfg, layout=layout)
    except ConfigError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        _let_rank0_report(rank)
        _shutdown(destroy_parallel)
        return EXIT_CONFIG_ERROR
    except TrainingStopped as exc:
        if rank == 0:
            print(str(exc), file=sys.stderr, flush=True)
        _shutdown(destroy_parallel)
        return EXIT_PREEMPTED
    _shutdown(destroy_parallel)
    return 0


def _let_rank0_report(rank: int, timeout_s: float = 10.0) -> None:
    """Hold the other ranks' exit until rank 0 has printed its error line: torchrun stops every rank as soon as
    one exits, and a rank 0 a moment behind would be killed before it says what is wrong. Bounded: an error
    that rank 0 never reaches costs the others ``timeout_s``, never a hang."""
    import datetime

    import torch.distributed as dist

    key = "mcore_agentic/config_error_reported"
    try:
        store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001 -- no store: fall back to a short pause
        store = None
    if store is None:
        if rank != 0:
            time.sleep(2.0)
        return
    try:
        if rank == 0:
            store.set(key, "1")
        else:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 -- rank 0 gone or never there: exit anyway
        pass


def _shutdown(destroy_parallel: Any) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        destroy_parallel(destroy_process_group=True)


@hydra.main(config_path="../configs", config_name="default_tiny", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    code = launch(dict_cfg)
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


if __name__ == "__main__":
    from mcore_agentic.config import check_overrides

    try:  # Hydra alone says "Key 'x' is not in struct"; name the nearest real key instead
        check_overrides([a for a in sys.argv[1:] if not a.startswith("-")])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG_ERROR)
    from omegaconf import OmegaConf

    from mcore_agentic.trainer.config import log_dir_of

    OmegaConf.register_new_resolver("log_dir", log_dir_of, replace=True)
    sys.argv = [sys.argv[0], *with_hydra_defaults(sys.argv[1:])]
    main()
