#!/bin/sh
# Claude Code as rollout.agent.command: Anthropic Messages at $ANTHROPIC_BASE_URL, headless (-p), every tool
# allowed (IS_SANDBOX=1: the sandbox, not the harness, is the boundary; it also lets a root trainer skip
# permissions). Its output goes to stderr (the trainer's log); the reward comes from rollout.agent.reward_command or
# the reward function. Its side calls (a title with a JSON schema, on ANTHROPIC_SMALL_FAST_MODEL) are side
# requests: served, counted, not trained.
set -eu
. "$(dirname "$0")/common.sh"
set -- -p "$TASK" --output-format json --model "$MODEL" --dangerously-skip-permissions
if [ "$LEAN" = 1 ]; then set -- "$@" --tools Bash --system-prompt "$LEAN_PROMPT"; fi
env IS_SANDBOX=1 DISABLE_AUTOUPDATER=1 DISABLE_TELEMETRY=1 DISABLE_ERROR_REPORTING=1 \
  ANTHROPIC_SMALL_FAST_MODEL="$MODEL-side" \
  "$BIN/claude" "$@" </dev/null 1>&2
