import json, sys
for run in sys.argv[1:]:
    rows = [r for r in map(json.loads, open(f"{run}/samples.jsonl")) if "suite" in r]
    by = {}
    for r in rows:
        by.setdefault((r["suite"], r.get("prompt_index", r.get("index"))), {})[r["method"]] = r.get("output_ids") or r.get("tokens")
    out = {}
    for (suite, i), m in by.items():
        a, b = m.get("ar"), m.get("ar-reference")
        if a is None or b is None: continue
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out.setdefault(suite, []).append(k)
    print(run, {s: (sum(v) / len(v), sorted(v)) for s, v in out.items()})
