"""The remote backend: the worker's engine interface served by an inference server over its
OpenAI-compatible HTTP API (vLLM, SGLang, llama.cpp's llama-server), which then does the
batching and the speculative decoding. `openai_client.py` is the HTTP transport,
`dialects.py` what each kind of server is sent and answers, `engine.py` the engine."""
