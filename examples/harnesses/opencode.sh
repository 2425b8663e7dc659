#!/bin/sh
# opencode as rollout.agent.command: OpenAI Chat Completions at $OPENAI_BASE_URL through its openai-compatible
# provider, `opencode run` headless, every permission allowed (the sandbox, not the harness, is the boundary). Its
# title call (another system prompt, no tools) is a side request. Output to stderr; the reward comes from
# rollout.agent.reward_command or the reward function.
set -eu
. "$(dirname "$0")/common.sh"
export OPENCODE_CONFIG="$HOME/opencode.json" OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_MODELS_FETCH=1 \
  OPENCODE_DISABLE_SHARE=1 XDG_CONFIG_HOME="$HOME/.config" XDG_DATA_HOME="$HOME/.local/share" \
  XDG_CACHE_HOME="$HOME/.cache" XDG_STATE_HOME="$HOME/.local/state"
cat >"$OPENCODE_CONFIG" <<JSON
{"model": "session/$MODEL", "small_model": "session/$MODEL", "autoupdate": false, "share": "disabled",
 "permission": {"*": "allow"}, "provider": {"session": {"npm": "@ai-sdk/openai-compatible", "name": "session",
 "options": {"baseURL": "$OPENAI_BASE_URL", "apiKey": "{env:OPENAI_API_KEY}"},
 "models": {"$MODEL": {"name": "$MODEL", "tool_call": true, "limit": {"context": 131072, "output": 8192}}}}}}
JSON
printf '%s' "$TASK" | "$BIN/opencode" run 1>&2  # on stdin: a positional prompt arrives wrapped in quotes
