import statistics, time
from types import SimpleNamespace
from dflash.loading import engine_from_args
from dflash.engine.target.protocol import TargetRow
from dflash.bench.backends import _ids
for backend in ("llamacpp", "ort"):
    eng = engine_from_args(SimpleNamespace(target=None, drafter=None, device="cpu", dtype="float32", threads=2,
                                           draft_dtype="auto", target_backend=backend))
    t = eng.target
    s = t.new_sequence()
    t.forward_batch([TargetRow(s, _ids(64), 1)], ())
    res = {(): [], tuple(eng.layer_ids): []}
    for r in range(60):
        for layers in (res if r % 2 == 0 else reversed(list(res))):
            a = time.perf_counter()
            t.forward_batch([TargetRow(s, [1234], 1)], layers)
            res[layers].append(time.perf_counter() - a)
            t.rollback(s, 64)
    print(backend, {("none" if not k else f"{len(k)} layers"): round(statistics.median(v) * 1000, 2) for k, v in res.items()})
    del eng, t
