"""Export the actor of a training checkpoint as a Hugging Face safetensors checkpoint.

    python launch/export_hf.py --checkpoint checkpoints/mcore_agentic/tiny_meter_reading/global_step_40 \\
        --out outputs/exported/tiny_meter_reading
    torchrun --nproc_per_node 2 launch/export_hf.py --checkpoint ... --out ... --tp 2   # big models

The checkpoint's ``config.json``-free ``actor/`` part (a Megatron distributed checkpoint,
readable at any TP/PP) is loaded into a Megatron model built from the run's base HF
checkpoint (``--base``, default: the ``model.model_path`` recorded in the run's
``trainer`` log config, else required), the bridge exports full HF tensors, and
:func:`mcore_agentic.models.hf_io.save_hf_checkpoint` writes them with the base
config and tokenizer, so ``AutoModelForCausalLM.from_pretrained(out)`` loads it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def _base_path(checkpoint: Path, base: str | None) -> Path:
    """The run's base HF checkpoint: ``--base``, else the ``model.model_path`` the checkpoint's config records
    (relative paths looked up like the trainer's: working directory, then the repository root)."""
    from mcore_agentic.config.paths import search_dirs

    if base:
        if not (Path(base) / "config.json").is_file():
            raise SystemExit(f"error: --base {base} has no config.json (working directory {Path.cwd()}): "
                             "pass the run's Hugging Face checkpoint directory")
        return Path(base)
    cfg_file = checkpoint / "config.json"
    if not cfg_file.is_file():
        raise SystemExit(f"error: --base is required: {checkpoint} records no model.model_path (pass the run's HF checkpoint)")
    recorded = json.loads(cfg_file.read_text()).get("model", {}).get("model_path")
    if not recorded:
        raise SystemExit(f"error: --base is required: {cfg_file} records no model.model_path (pass the run's HF checkpoint)")
    dirs = [Path(recorded)] if Path(recorded).is_absolute() else [d / recorded for d in search_dirs()]
    for candidate in dirs:
        if (candidate / "config.json").is_file():
            return candidate
    raise SystemExit(
        f"error: model.model_path recorded in {cfg_file} is {recorded}, which has no config.json "
        f"(looked in {', '.join(str(d) for d in dirs)}): pass --base <the run's Hugging Face checkpoint>"
    )


def export(checkpoint: str | Path, out: str | Path, *, base: str | None = None, tp: int = 1, pp: int = 1,
           dtype: str = "float32") -> Path:
    """Export ``checkpoint``'s actor to ``out`` (collective when run under torchrun); returns ``out``."""
    import torch.distributed as dist

    import megatron_patches
    from mcore_agentic.config.rules import check_world_size
    from mcore_agentic.models.hf_io import load_hf_config, save_hf_checkpoint
    from mcore_agentic.models.spec import ModelSpec
    from mcore_agentic.parallel import comm
    from mcore_agentic.parallel.config import ParallelConfig
    from mcore_agentic.parallel.layout import destroy_parallel, init_distributed, initialize_parallel
    from mcore_agentic.trainer.model_checkpoint import load_worker
    from mcore_agentic.workers.megatron_model import MegatronModel

    checkpoint, out = Path(checkpoint), Path(out)
    actor_dir = checkpoint / "actor"
    if not actor_dir.is_dir():
        raise SystemExit(f"error: --checkpoint {checkpoint} has no actor/ part (working directory {Path.cwd()}): "
                         "pass a global_step_<k> directory of a training run")
    base_path = _base_path(checkpoint, base)
    megatron_patches.apply()
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    init_distributed()
    check_world_size(parallel, dist.get_world_size(), field_prefix="--tp/--pp")
    layout = initialize_parallel(parallel, seed=0)
    try:
        from mcore_agentic.trainer.checkpoint import CheckpointManager, summarize

        problems = CheckpointManager(checkpoint.parent).verify(checkpoint)  # every byte, split across ranks
        if problems:
            raise SystemExit(f"error: {checkpoint} fails verification: {summarize(problems)}; export another checkpoint")
        model = MegatronModel(ModelSpec(base_path, dtype, parallel=parallel), layout, optim=None)
        load_worker(actor_dir, model, load_optimizer=False)
        tensors = model.bridge.export_hf_weights(model.chunks)  # collective: every rank iterates
        if layout.rank == 0:
            save_hf_checkpoint(out, tensors, load_hf_config(base_path))
            for name in TOKENIZER_FILES:
                if (base_path / name).is_file():
                    shutil.copy2(base_path / name, out / name)
        else:
            for _ in tensors:
                pass
        comm.barrier()
    finally:
        destroy_parallel()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a global_step_<k> directory written by the trainer")
    p.add_argument("--out", required=True, help="output directory for the HF checkpoint")
    p.add_argument("--base", default=None, help="the run's base HF checkpoint (config + tokenizer)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size used to load (any; default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size used to load (any; default 1)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = p.parse_args(argv)
    out = export(args.checkpoint, args.out, base=args.base, tp=args.tp, pp=args.pp, dtype=args.dtype)
    print(f"exported {args.checkpoint} -> {out}")


if __name__ == "__main__":
    main()
