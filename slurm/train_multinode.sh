#!/bin/bash
# Multi-node RL training under Slurm: one torchrun per node, rendezvous on the first node.
#
#   sbatch --nodes=4 slurm/train_multinode.sh --config-name gsm8k_multiturn_grpo model=qwen2_5_7b
#   RAY_TOOL_POOL=1 sbatch slurm/train_multinode.sh ...      # tools/rewards on a Ray pool across the nodes
#
# Everything after the script name is passed to launch/pretrain_rl.py unchanged (Hydra overrides).
# Environment knobs: REPO_DIR (default: the submit dir), VENV (a virtualenv to activate),
# NPROC_PER_NODE (default: GPUs on the node), MASTER_PORT, LOG_ROOT (default: $REPO_DIR/logs/slurm),
# RAY_TOOL_POOL=1 and RAY_PORT (default 6379), REQUEUE (default 1), SHUTDOWN_TIMEOUT (default 900),
# PREFLIGHT (default 1: the pre-flight on the batch node first) and PYTHON (its interpreter, default python).
# See docs/slurm.md.
#
# Preemption and time limits: Slurm sends this script SIGUSR1 10 minutes before the time limit
# (--signal=B:USR1@600); the script forwards it to the ranks, which finish their step, checkpoint
# and exit, and then requeues the job (scontrol requeue): the next run resumes from that checkpoint
# (trainer.resume_mode=auto). A preemption's SIGTERM reaches the ranks from Slurm directly; with
# --requeue Slurm puts the job back in the queue itself.
#SBATCH --job-name=mcore-agentic
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --exclusive
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
# Slurm does not create directories for --output; this file lands in the submit dir and the
# per-node logs go to the per-job log dir made below.
#SBATCH --output=slurm-%x-%j.out

set -euo pipefail

: "${SLURM_JOB_ID:?run this under sbatch or salloc}"
: "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}"
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}
cd "$REPO_DIR"
if [[ -n "${VENV:-}" ]]; then
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
fi

NNODES=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:?SLURM_NNODES is not set}}

# GPUs per node: SLURM_GPUS_ON_NODE (set with --gpus-per-node), else the count in
# SLURM_GPUS_PER_NODE ("8" or "h100:8"), else 1. NPROC_PER_NODE overrides (e.g. CPU runs).
gpus_per_node() {
    if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        echo "$SLURM_GPUS_ON_NODE"
    elif [[ -n "${SLURM_GPUS_PER_NODE:-}" ]]; then
        echo "${SLURM_GPUS_PER_NODE##*:}"
    else
        echo 1
    fi
}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(gpus_per_node)}

# Read the whole list (a `| head -1` could SIGPIPE scontrol, which pipefail turns into an exit).
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if ((${#NODES[@]} == 0)); then
    echo "error: scontrol returned no hosts for SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST" >&2
    exit 1
fi
HEAD_NODE=${NODES[0]}
# A port derived from the job id keeps two jobs sharing a head node apart.
MASTER_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 10000))}
export MASTER_ADDR=$HEAD_NODE MASTER_PORT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1

LOG_ROOT=${LOG_ROOT:-$REPO_DIR/logs/slurm}
LOG_DIR=$LOG_ROOT/${SLURM_JOB_NAME:-mcore-agentic}-$SLURM_JOB_ID
mkdir -p "$LOG_DIR"
echo "job $SLURM_JOB_ID (start ${SLURM_RESTART_COUNT:-0}): $NNODES nodes x $NPROC_PER_NODE processes, rendezvous $HEAD_NODE:$MASTER_PORT, logs $LOG_DIR"

OVERRIDES=("$@")
# Metrics go next to the node logs unless the command line says otherwise.
has_log_dir=0
for arg in "$@"; do
    [[ "$arg" == trainer.log_dir=* || "$arg" == +trainer.log_dir=* || "$arg" == ++trainer.log_dir=* ]] && has_log_dir=1
done
if [[ $has_log_dir == 0 ]]; then
    OVERRIDES+=("trainer.log_dir=$LOG_DIR")
fi

# The pre-flight (config, paths, tools, reward function, data) on the batch node, for the whole world, before any
# step starts: a bad config fails in seconds with one line per problem and is not requeued.
if [[ "${PREFLIGHT:-1}" == 1 ]]; then
    if ! "${PYTHON:-python}" launch/pretrain_rl.py --check --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" \
        "${OVERRIDES[@]}"; then
        echo "error: the pre-flight failed (lines above); nothing was started" >&2
        exit 2
    fi
fi

BACKGROUND=()
cleanup() {
    for pid in "${BACKGROUND[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT

if [[ "${RAY_TOOL_POOL:-0}" == 1 ]]; then
    RAY_PORT=${RAY_PORT:-6379}
    export RAY_ADDRESS=$HEAD_NODE:$RAY_PORT
    # Tools and reward functions only: the Ray pool gets CPUs, never the GPUs training uses.
    srun --overlap --nodes=1 --ntasks=1 -w "$HEAD_NODE" --output="$LOG_DIR/ray-head.log" \
        ray start --head --node-ip-address="$HEAD_NODE" --port="$RAY_PORT" --num-gpus=0 --block &
    BACKGROUND+=($!)
    ray_up=0
    for _ in $(seq 1 60); do
        if ray status --address="$RAY_ADDRESS" >/dev/null 2>&1; then
            ray_up=1
            break
        fi
        sleep 2
    done
    if [[ $ray_up == 0 ]]; then
        echo "error: Ray head on $RAY_ADDRESS did not come up; see $LOG_DIR/ray-head.log" >&2
        exit 1
    fi
    if ((NNODES > 1)); then
        srun --overlap --nodes=$((NNODES - 1)) --ntasks=$((NNODES - 1)) --ntasks-per-node=1 \
            --exclude="$HEAD_NODE" --output="$LOG_DIR/ray-worker-%N.log" \
            ray start --address="$RAY_ADDRESS" --num-gpus=0 --block &
        BACKGROUND+=($!)
    fi
    OVERRIDES+=("rollout.multi_turn.tool_executor=ray")
fi

# Stop signals. SIGUSR1 (the time-limit warning, sent to this script only) is forwarded to the
# training step; srun passes it on to torchrun, which forwards it to the ranks (--signals-to-handle) and
# waits SHUTDOWN_TIMEOUT seconds for them to checkpoint and exit. SIGTERM (preemption, scancel) is sent
# by Slurm to every process of the job itself: the script only keeps waiting so the ranks can save.
STOP_SIGNAL=""
TRAPPED=0
TRAIN_PID=""
on_usr1() {
    STOP_SIGNAL=USR1
    TRAPPED=1
    echo "$(date +%H:%M:%S) SIGUSR1: the time limit is near; the ranks finish their step, checkpoint and stop"
    if [[ -n "$TRAIN_PID" ]]; then kill -USR1 "$TRAIN_PID" 2>/dev/null || true; fi
}
on_term() {
    STOP_SIGNAL=${STOP_SIGNAL:-TERM}
    TRAPPED=1
    echo "$(date +%H:%M:%S) SIGTERM: the ranks finish their step, checkpoint and stop"
}
trap on_usr1 USR1
trap on_term TERM

# torchrun forwards SIGUSR1 and waits for the ranks only with these options (torch 2.9 and 2.11+);
# an older torchrun forwards SIGTERM alone and kills the ranks 30 s later.
TORCHRUN_HELP=$(torchrun --help 2>/dev/null || true)
SIGNAL_ARGS=()
if [[ "$TORCHRUN_HELP" == *--signals-to-handle* ]]; then
    SIGNAL_ARGS+=(--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1)
else
    echo "warning: this torchrun cannot forward SIGUSR1 (no --signals-to-handle; torch >= 2.9 has it):" \
        "the time-limit warning will not reach the ranks" >&2
fi
if [[ "$TORCHRUN_HELP" == *--shutdown-timeout* ]]; then
    SIGNAL_ARGS+=(--shutdown-timeout "${SHUTDOWN_TIMEOUT:-900}")
else
    echo "warning: this torchrun has no --shutdown-timeout: it kills the ranks 30 s after forwarding a signal" >&2
fi

srun --overlap --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --open-mode=append \
    --output="$LOG_DIR/train-%N.log" \
    torchrun \
    --nnodes "$NNODES" \
    --nproc_per_node "$NPROC_PER_NODE" \
    --rdzv_id "$SLURM_JOB_ID" \
    --rdzv_backend c10d \
    --rdzv_endpoint "$HEAD_NODE:$MASTER_PORT" \
    "${SIGNAL_ARGS[@]}" \
    launch/pretrain_rl.py "${OVERRIDES[@]}" &
TRAIN_PID=$!
if [[ "$STOP_SIGNAL" == USR1 ]]; then  # the warning came while the script was still starting up
    kill -USR1 "$TRAIN_PID" 2>/dev/null || true
fi
# `wait` returns early (status > 128) when a trapped signal arrives: wait again until the step has
# ended; bash keeps the status of a finished background job, so the last wait returns srun's own.
while :; do
    TRAPPED=0
    set +e
    wait "$TRAIN_PID"
    TRAIN_RC=$?
    set -e
    if ((TRAPPED == 1 && TRAIN_RC > 128)); then
        continue
    fi
    break
done

if [[ "$STOP_SIGNAL" == USR1 && "${REQUEUE:-1}" == 1 ]]; then
    echo "requeueing job $SLURM_JOB_ID: its next start resumes from the checkpoint the ranks just wrote"
    scontrol requeue "$SLURM_JOB_ID" || echo "warning: scontrol requeue $SLURM_JOB_ID failed; resubmit the job to resume" >&2
fi
exit "$TRAIN_RC"
