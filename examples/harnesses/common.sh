# Shared by the harness recipes (sourced): the task, the harness binaries, a HOME of the sample's own.
#
# The trainer runs a recipe once per sample as rollout.agent.command (docs/agents.md, "Coding harnesses") with
# OPENAI_BASE_URL / ANTHROPIC_BASE_URL / *_API_KEY naming the sample's session and MCORE_AGENTIC_ROW its row.
# The task is the row's last user message. HARNESS_BIN: where `npm install --prefix DIR <harness>` put the
# binaries (default: the repository's .harnesses, which `make harnesses` fills). HARNESS_MODEL: the model name the
# harness sends (default policy). HARNESS_LEAN=1: the harness's shell tool only and a one-line system prompt, for
# tiny models with short contexts; unset, the harness runs as it ships (10-40k tokens of prompt and tools).
: "${MCORE_AGENTIC_ROW:?run a recipe as rollout.agent.command: the trainer sets MCORE_AGENTIC_ROW}"
RECIPES=$(cd "$(dirname "$0")" && pwd)
BIN=${HARNESS_BIN:-$RECIPES/../../.harnesses/node_modules/.bin}
MODEL=${HARNESS_MODEL:-policy}
LEAN=${HARNESS_LEAN:-0}
LEAN_PROMPT="You are a coding agent. Act in the current directory with the shell tool, then answer briefly."
TASK=$(node -e '
  const row = JSON.parse(require("fs").readFileSync(process.env.MCORE_AGENTIC_ROW, "utf8"));
  const users = (row.prompt || []).filter((m) => m.role === "user");
  const c = users.length ? users[users.length - 1].content : "";
  process.stdout.write(typeof c === "string" ? c : c.map((p) => p.text || "").join("\n"));')
# Harnesses keep config, sessions and caches in HOME: each sample gets its own (the sandbox gives one already;
# unsandboxed, concurrent samples would share the trainer's).
HOME=$(mktemp -d "${TMPDIR:-/tmp}/harness-home.XXXXXX")
export HOME
trap 'rm -rf "$HOME"' EXIT
