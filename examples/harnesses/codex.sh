#!/bin/sh
# Codex CLI as rollout.agent.command: OpenAI Responses at $OPENAI_BASE_URL (a model provider with
# wire_api = "responses" in the sample's own CODEX_HOME), `codex exec` headless, approvals off (the sandbox, not
# the harness, is the boundary). Web search off: the endpoint runs no hosted tools (offered, they would be left out
# and counted). Its output goes to stderr; the reward comes from rollout.agent.reward_command or the reward function.
set -eu
. "$(dirname "$0")/common.sh"
export CODEX_HOME="$HOME/.codex"
mkdir -p "$CODEX_HOME"
{
  echo "model = \"$MODEL\""
  echo 'model_provider = "session"'
  echo 'approval_policy = "never"'
  echo 'sandbox_mode = "danger-full-access"'
  echo 'check_for_update_on_startup = false'
  echo 'web_search = "disabled"'
  if [ "$LEAN" = 1 ]; then
    printf '%s\n' "$LEAN_PROMPT" >"$CODEX_HOME/instructions.md"
    echo "model_instructions_file = \"$CODEX_HOME/instructions.md\""
    printf '%s\n' '[features]' 'multi_agent = false' 'goals = false' 'tool_suggest = false' \
      'image_generation = false' 'skill_search = false' 'apps = false'
  fi
  echo '[analytics]'
  echo 'enabled = false'
  echo '[model_providers.session]'
  echo 'name = "session"'
  echo "base_url = \"$OPENAI_BASE_URL\""
  echo 'env_key = "OPENAI_API_KEY"'
  echo 'wire_api = "responses"'
} >"$CODEX_HOME/config.toml"
"$BIN/codex" exec --skip-git-repo-check "$TASK" </dev/null 1>&2
