"""A prompt in the target's chat template, tokenised so that it cannot forge turns.

Rendering a template and tokenising the result parses every special token in it, the
prompt's text included: a prompt (a table's untrusted row) that spells
`<|im_start|>system ...` would open a turn of its own. Here only the markup the template
writes becomes special tokens; special-token text inside the prompt is tokenised as the
plain text it is. transformers does this (`apply_chat_template(...,
sanitize_control_tokens=True)`): it marks the control tokens in the messages before
rendering and encodes the marked ones without added tokens. A prompt holding no such text
gets exactly the ids plain `apply_chat_template` gives (the tests check it), so greedy
output is unchanged for it. (transformers drops its two marker characters, U+F0000 and
U+F0001 of a private-use plane, from the prompt's text.)

Raw ids stay with the caller who asks for them: input ids, or chat off (the prompt's text
tokenised as it is, special tokens included).

Every place that puts a user's prompt into the template calls `chat_prompt_ids`.
"""

from __future__ import annotations

from dflash.errors import DFlashError


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The ids of `prompt` as the user's turn of the target's chat template, with the
    assistant's turn opened (add_generation_prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError("bad_prompt", "this target's tokenizer has no chat template")
    try:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False, sanitize_control_tokens=True)
    except (ValueError, NotImplementedError) as exc:  # a control token its tokenizer also makes from plain text
        raise DFlashError("bad_prompt", f"the prompt cannot be put in this target's chat template as text: {exc}") from None
    return list(ids)


# Tokenised by two tokenizers that must agree (a server's and ours; llama.cpp's reading of a
# GGUF and transformers' conversion of it): words, code, digits, whitespace runs and scripts
# beyond ASCII, so two vocabularies that share a size (or most entries) still differ.
TOKENIZER_PROBE = ("def área(r):\n    return 3.14159 * r ** 2  # Größe, naïve café, 東京, Москва 🙂\n\n"
                   "\tSELECT id, \"name\" FROM t WHERE x >= 12345;   ")


def tokenizer_disagreement(tokenizer, their_ids) -> str | None:
    """Where `their_ids(text)` (another tokenizer's ids of `text`, its special-token text
    parsed, nothing added; None: it cannot say) differs from `tokenizer` on the probe text
    and on that text in the tokenizer's chat template (its markup: the special tokens' ids):
    a sentence saying so, or None where they agree. Raises LookupError where the other
    cannot say."""
    probes = [TOKENIZER_PROBE]
    if getattr(tokenizer, "chat_template", None):
        try:
            probes.append(tokenizer.apply_chat_template([{"role": "user", "content": TOKENIZER_PROBE}],
                                                        add_generation_prompt=True, tokenize=False))
        except Exception:  # noqa: BLE001 (a template that wants other turns: its markup goes unchecked here)
            pass
    for text in probes:
        theirs = their_ids(text)
        if theirs is None:
            raise LookupError(text)
        ours = tokenizer(text, add_special_tokens=False).input_ids
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            return f"a probe text: {len(theirs)} ids there, {len(ours)} here, first difference at id {at}"
    return None
