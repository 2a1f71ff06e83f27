"""Offline prompt sources for drafter training.

Everything here is present on a Debian machine with Python, with no download:
- the standard library: documented functions, classes and methods become "explain it",
  "write code in its spirit" and HumanEval-shaped "complete this function" prompts
  (signature + docstring, the shape of the code suite, from a disjoint source);
- man pages (`man -k .`): one-line descriptions of commands, files and functions;
- the project's own instruction lists: `prompts.txt`, and general topics x instruction
  templates (`topics.txt`), for the chat distribution.

The responses are always the target's own (data.py); these only decide what it is asked.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).parent
PROMPT_FILE = HERE / "prompts.txt"
TOPIC_FILE = HERE / "topics.txt"

TEMPLATES_FUNC = (
    "Explain what the Python function {qual} does and show a short example.",
    "Write a Python function that does the following: {doc}",
    "When would you use {qual} in Python? Give an example.",
    "Show how to call {qual} correctly, and one common mistake to avoid.",
)
TEMPLATES_CLASS = (
    "Explain the Python class {qual} and show how to use it.",
    "Write a short Python example that uses {qual}.",
    "What problem does {qual} solve in Python? Answer briefly with code.",
)
TEMPLATES_MAN = (
    "What does the `{name}` command do? ({desc})",
    "Explain how to use {name}: {desc}. Give an example.",
    "I need to {desc_lower}. How would I do that on Linux?",
    "Write a short tutorial on {name} ({desc}).",
)
TEMPLATES_TOPIC = (
    "Explain {topic} in simple terms.",
    "Write a short paragraph about {topic}.",
    "List five interesting facts about {topic}.",
    "What are the main pros and cons of {topic}?",
    "Give me three tips related to {topic}.",
    "Summarize the key ideas of {topic} in three bullet points.",
    "Describe {topic} to a ten-year-old.",
    "Write a question and answer about {topic}.",
    "What are common misconceptions about {topic}?",
    "Write a haiku about {topic}.",
    "Write a short poem about {topic}.",
    "Write a friendly email to a friend about {topic}.",
    "Give a step-by-step guide to getting started with {topic}.",
    "Compare {topic} with {other}.",
    "Why does {topic} matter? Answer in two sentences.",
    "Write the opening of a short story that involves {topic}.",
    "Create a short quiz with three questions about {topic}.",
    "What would a beginner need to know about {topic}?",
    "Rewrite this sentence to be more formal: \"{topic} is kind of a big deal\".",
    "Give a one-sentence definition of {topic}.",
)


def _first_line(doc: str) -> str:
    return doc.strip().split("\n\n")[0].replace("\n", " ").strip()[:200]


def _stdlib_module_names() -> list[str]:
    names = sorted(getattr(sys, "stdlib_module_names", ()))
    skip = ("antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle", "lib2to3", "ensurepip", "pydoc_data")
    return [n for n in names if not n.startswith("_") and n not in skip]


def _stdlib_objects():
    """(qualified name, object) for documented public callables of importable stdlib modules."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _stdlib_module_names():
            try:
                mod = importlib.import_module(name)
            except Exception:  # platform-only or deprecated modules
                continue
            for attr, obj in sorted(vars(mod).items()):
                if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                    continue
                if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                    continue
                yield f"{name}.{attr}", obj
                if inspect.isclass(obj):
                    for m_name, m in sorted(vars(obj).items()):
                        if not m_name.startswith("_") and (inspect.isfunction(m) or inspect.ismethoddescriptor(m)):
                            yield f"{name}.{attr}.{m_name}", m


def humaneval_shaped(qual: str, obj) -> str | None:
    """`def name(sig):\n    \"\"\"doc\"\"\"\n` for a pure-Python function with a plain signature."""
    if not inspect.isfunction(obj):
        return None
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    doc = inspect.getdoc(obj) or ""
    if "<" in sig or len(sig) > 120 or not 30 <= len(doc) <= 600 or '"""' in doc:
        return None
    body = "\n".join(("    " + line).rstrip() for line in doc.splitlines())
    return f'def {obj.__name__}{sig}:\n    """\n{body}\n    """\n'


def stdlib_prompts(seed: int = 0, per_object: int = 2) -> list[str]:
    rng = random.Random(seed)
    out = []
    for qual, obj in _stdlib_objects():
        doc = inspect.getdoc(obj)
        if not doc or len(doc) < 20:
            continue
        templates = TEMPLATES_CLASS if inspect.isclass(obj) else TEMPLATES_FUNC
        for t in rng.sample(templates, min(per_object, len(templates))):
            out.append(t.format(qual=qual, doc=_first_line(doc)))
        shaped = humaneval_shaped(qual, obj)
        if shaped:
            out.append(shaped)
    return out


def man_prompts(seed: int = 0, limit: int | None = None) -> list[str]:
    """One prompt per man page summary line (`man -k .`); empty where man is missing."""
    if not shutil.which("man"):
        return []
    try:
        text = subprocess.run(["man", "-k", "."], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rng = random.Random(seed)
    out = []
    for line in text.splitlines():
        m = re.match(r"^(\S+) \((\w+)\)\s+- (.+)$", line)
        if not m or len(m.group(3)) < 12 or m.group(3).endswith("..."):
            continue
        name, desc = m.group(1), m.group(3).strip().rstrip(".")
        out.append(rng.choice(TEMPLATES_MAN).format(name=name, desc=desc, desc_lower=desc[0].lower() + desc[1:]))
    rng.shuffle(out)
    return out[:limit] if limit else out


def _lines(path: Path) -> list[str]:
    if not path.is_file():
        return []
    return [s.strip() for s in path.read_text().splitlines() if s.strip() and not s.startswith("#")]


def project_prompts() -> list[str]:
    return _lines(PROMPT_FILE)


def topic_prompts(seed: int = 0, per_topic: int = 12) -> list[str]:
    rng = random.Random(seed)
    topics = _lines(TOPIC_FILE)
    out = []
    for topic in topics:
        for t in rng.sample(TEMPLATES_TOPIC, per_topic):
            out.append(t.format(topic=topic, other=rng.choice(topics)))
    return out


def prompts_by_source(seed: int = 0) -> dict[str, list[str]]:
    # Man pages are capped so that command-line questions do not swamp the chat and code prompts.
    return {"project": project_prompts(), "topics": topic_prompts(seed), "stdlib": stdlib_prompts(seed),
            "man": man_prompts(seed, limit=6000)}


def all_prompts(seed: int = 0) -> list[str]:
    return [p for prompts in prompts_by_source(seed).values() for p in prompts]
