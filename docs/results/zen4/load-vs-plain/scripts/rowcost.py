import time, statistics, random
from dflash.cli import build_parser
from dflash.loading import engine_from_args
from dflash.engine.target.protocol import TargetRow
args = build_parser().parse_args(["bench", "--threads", "2"])
eng = engine_from_args(args); eng.max_batch = 16
curve = eng.cost_curve
t = eng.target
random.seed(0)
seqs = [t.new_sequence() for _ in range(8)]
for s in seqs:
    t.forward_batch([TargetRow(s, [random.randrange(1000, 20000) for _ in range(100)], 1)])
base = [s.length for s in seqs]
layouts = {"8x1": [1]*8, "1x2+7x1": [2]+[1]*7, "2x2+6x1": [2,2]+[1]*6, "1x4+7x1": [4]+[1]*7, "8x2": [2]*8, "1x8+7x1": [8]+[1]*7, "4x1":[1]*4, "1x2+3x1":[2,1,1,1], "4x2":[2]*4}
res = {k: [] for k in layouts}
for rnd in range(25):
    for name, lay in layouts.items():
        for s, b in zip(seqs, base): t.rollback(s, b)
        rows = [TargetRow(s, [5000 + j for j in range(n)], n) for s, n in zip(seqs, lay)]
        a = time.perf_counter(); t.forward_batch(rows, (1, 9, 18, 27, 29)); res[name].append(time.perf_counter() - a)
for k, v in res.items():
    lay = layouts[k]
    print(f"{k:10s} measured {statistics.median(v)*1e3:6.2f} ms  curve {curve.forward_s(len(lay), sum(lay))*1e3:6.2f} ms")
