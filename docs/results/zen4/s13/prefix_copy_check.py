"""Is a llama.cpp prefix copy (the whole stream copied across streams, then cut at the prefix)
bit-identical to computing the prompt from scratch? SmolLM2 Q4_1, non-unified KV, calls of <= 63 rows
(the timings are of a machine running CI beside it: not a measurement)."""
import time, torch
from pathlib import Path
from dflash.engine.target.llamacpp import LlamaCppTarget
from dflash.engine.target.protocol import TargetRow
from dflash.model_files import default_target_gguf, resolve_target
folder = resolve_target(None, quiet=True).folder
t = LlamaCppTarget(default_target_gguf(), folder, threads=1, context=2048)
C = t._C
P = [(1000 + 37 * i) % 49000 for i in range(300)]
for cut in (60, 63, 126, 200):
    a = t.new_sequence()
    t.forward_batch([TargetRow(a, P[:250], 1)])           # the cached request (longer than the prefix)
    t.forward_batch([TargetRow(a, [5, 6, 7], 3)])           # it went on decoding
    b = t.new_sequence(); b.seq_id = t._free_ids.pop()
    s = time.perf_counter()
    C.llama_memory_seq_cp(t.mem, a.seq_id, b.seq_id, -1, -1)
    ok = C.llama_memory_seq_rm(t.mem, b.seq_id, cut, -1)
    b.length = cut
    lb = t.forward_batch([TargetRow(b, P[cut:300], 4)]).logits[0]
    el = time.perf_counter() - s
    c = t.new_sequence()
    lc = t.forward_batch([TargetRow(c, P[:300], 4)]).logits[0]
    # and decode two more steps on each
    db = t.forward_batch([TargetRow(b, [11], 1)]).logits[0]; dc = t.forward_batch([TargetRow(c, [11], 1)]).logits[0]
    print(f"cut {cut}: rm ok {ok}, prompt rows equal {torch.equal(lb, lc)}, next step equal {torch.equal(db, dc)}, "
          f"max diff {float((lb - lc).abs().max()):.3g}; copy+rest {el*1000:.0f} ms", flush=True)
    for s_ in (a, b, c): t.free(s_)
