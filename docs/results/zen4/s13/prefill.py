"""llama.cpp's prefill of a 256-token prompt of the 1.5B, in calls of at most 63 rows (what
the llamacpp backend does, dflash.engine.target.llamacpp.BATCH_TOKENS) against calls of 512
(what llama-server does): the median of 5 rounds, each on a fresh KV cache."""
import statistics
import sys
import time

from llama_cpp import Llama

gguf = sys.argv[1]
tokens = [1000 + (37 * i) % 50000 for i in range(256)]
for n_batch in (63, 512, 63, 512):
    llm = Llama(gguf, n_ctx=1024, n_batch=n_batch, n_ubatch=n_batch, n_threads=2, n_threads_batch=2,
                verbose=False)
    times = []
    for _ in range(5):
        llm.reset()
        llm._ctx.memory_clear(True) if hasattr(llm._ctx, "memory_clear") else None
        t = time.perf_counter()
        llm.eval(tokens)
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    print(f"calls of {n_batch:3d} rows: 256-token prefill {med * 1000:.0f} ms ({med * 1000 / 256:.2f} ms a token)",
          flush=True)
    del llm
