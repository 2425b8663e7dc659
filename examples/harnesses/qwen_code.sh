#!/bin/sh
# Qwen Code as rollout.agent.command: OpenAI Chat Completions at $OPENAI_BASE_URL, headless, approvals off (yolo:
# the sandbox, not the harness, is the boundary). Its output goes to stderr; the reward comes from
# rollout.agent.reward_command or the reward function.
set -eu
. "$(dirname "$0")/common.sh"
mkdir -p "$HOME/.qwen"
echo '{"privacy": {"usageStatisticsEnabled": false}, "telemetry": {"enabled": false},
       "general": {"enableAutoUpdate": false}}' >"$HOME/.qwen/settings.json"
set -- "$TASK" --auth-type openai --approval-mode yolo --output-format json
if [ "$LEAN" = 1 ]; then  # its own system prompt file, and the shell tool alone
  printf '%s\n' "$LEAN_PROMPT" >"$HOME/.qwen/system.md"
  export QWEN_SYSTEM_MD="$HOME/.qwen/system.md"
  set -- "$@" --core-tools run_shell_command --exclude-tools agent skill tool_search task_stop send_message
fi
env OPENAI_MODEL="$MODEL" "$BIN/qwen" "$@" </dev/null 1>&2
