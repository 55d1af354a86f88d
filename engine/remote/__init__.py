"""Remote backends: real serving engines (vLLM, llama.cpp's server, any OpenAI-compatible one) as event sources.

client.py speaks HTTP and SSE; sse.py parses chunks; metrics.py reads /metrics; backend.py yields engine events;
bench.py is the load benchmark (`serve-bench`) with `vllm bench serve`'s definitions; cli.py the `--url` commands.
"""
