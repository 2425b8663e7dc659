"""``python -m mcore_agentic.endpoint serve --model DIR``: the standalone session endpoint (endpoint/serve.py)."""

import sys

from mcore_agentic.endpoint.serve import serve

if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        sys.exit("usage: python -m mcore_agentic.endpoint serve --model DIR [--port 8000] [--engine hf|vllm] ...")
    serve(sys.argv[2:])
