"""The head's two products in numpy fp32, single-threaded OpenBLAS (threadpoolctl, pip install threadpoolctl), with the caches evicted before each as the target's forward does: memory-bound. Zen 4, 2026-12-05: full head 0.73 ms, half the bytes 0.36 ms."""
import time, numpy as np
from threadpoolctl import threadpool_limits
threadpool_limits(1, "blas")
rng = np.random.default_rng(0)
P = rng.standard_normal((576, 1152)).astype(np.float32); E = rng.standard_normal((2048, 576)).astype(np.float32)
E1 = E[:1024].copy(); Ph = P[:, :576].copy()
junk = np.ones(200_000_000 // 8)
x = rng.standard_normal(1152).astype(np.float32)
def cold(f, n=30):
    ts = []
    for _ in range(n):
        junk.sum()  # evict caches as the target's forward does
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e3
print("full (P 1152x576 + E 2048):", cold(lambda: E @ (P @ x)))
print("h-only P + E 1024:", cold(lambda: E1 @ (Ph @ x[:576])))
print("E 2048 alone:", cold(lambda: E @ x[:576]), " P alone:", cold(lambda: P @ x))
