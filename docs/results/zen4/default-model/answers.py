"""The default-model decision's answers: each candidate target answers the same four prompts
through `dflash generate` (greedy, block length auto, 2 threads, 96 new tokens at most), one
command per prompt, alone on the machine; writes answers.json and answers.md here."""
import json, subprocess, sys, time
from pathlib import Path

HERE = Path(__file__).parent
MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
PROMPTS = [
    "Write a haiku about databases.",
    "Write a PostgreSQL query that lists the five customers with the most orders, given tables "
    "customers(id, name) and orders(id, customer_id, placed_at).",
    "Summarize in one sentence: The nightly backup job failed twice this week because the disk on the "
    "replica filled up; we moved old WAL files to cold storage and added an alert at 80% usage.",
    "Classify the sentiment of this review as positive, negative or neutral, and answer with the label "
    "only: 'The checkout was quick but the package arrived damaged.'",
]
rows = []
for model in MODELS:
    for prompt in PROMPTS:
        cmd = [sys.executable, "-m", "dflash.cli", "generate", "--target", model, "--threads", "2",
               "--prompt", prompt, "--max-new-tokens", "96", "--json"]
        start = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        wall = time.monotonic() - start
        gen = json.loads(out.stdout)
        rows.append({"model": model, "prompt": prompt, "text": gen["text"], "new_tokens": gen["new_tokens"],
                     "tokens_per_s": gen["tokens_per_s"], "command_s": round(wall, 1),
                     "target_backend": gen.get("target_backend")})
        print(model, round(gen["tokens_per_s"], 1), repr(gen["text"][:80]), flush=True)
(HERE / "answers.json").write_text(json.dumps(rows, indent=1) + "\n")
md = ["| model | prompt | answer | new tokens | tokens/s | command (load included) |", "|---|---|---|---|---|---|"]
for r in rows:
    text = r["text"].strip().replace("|", "\\|").replace("\n", "<br>")
    md.append(f"| {r['model']} | {r['prompt'][:40]}… | {text} | {r['new_tokens']} | {r['tokens_per_s']:.1f} | "
              f"{r['command_s']} s |")
(HERE / "answers.md").write_text("\n".join(md) + "\n")
