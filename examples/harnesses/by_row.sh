#!/bin/sh
# Several harnesses in one run: each row names its recipe in extra_info.harness (claude_code, codex, qwen_code or
# opencode; default: $HARNESS, else claude_code), and this runs it.
set -eu
: "${MCORE_AGENTIC_ROW:?run a recipe as rollout.agent.command: the trainer sets MCORE_AGENTIC_ROW}"
HARNESS=$(node -e '
  const row = JSON.parse(require("fs").readFileSync(process.env.MCORE_AGENTIC_ROW, "utf8"));
  process.stdout.write(((row.extra_info || {}).harness || process.env.HARNESS || "claude_code").replace(/[^a-z_]/g, ""));')
exec /bin/sh "$(dirname "$0")/$HARNESS.sh"
