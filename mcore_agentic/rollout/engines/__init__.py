"""Generation engines behind one async interface: transformers (CPU) and SGLang (GPU, optional)."""
