"""One table of error codes (dflash.error_codes): every code the source raises is in it,
every code in it is raised somewhere, the docs show it as it is, and nothing else keeps a
second list of SQLSTATEs, bad-input codes or final queue codes."""

import re
from pathlib import Path

from dflash import error_codes
from dflash.error_codes import BY_CODE, ERROR_CODES

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for p in sorted((ROOT / "worker" / "dflash").rglob("*.py")) if p.name != "error_codes.py"]
SOURCES.append(ROOT / "plpython" / "dflash_pg.py")
RAISED = re.compile(r"(?:DFlashError|WorkerError|ProtocolError)\(\s*\"([a-z_]+)\"")
# The codes made from a variable or by the transport, not by a literal raise.
INDIRECT = {"error", "closed", "internal", "bad_frame", "bad_version", "duplicate_id", "unavailable", "busy",
            "shutting_down", "deadline", "cancelled", "frame_too_large", "context_exceeded", "bad_input_ids",
            "bad_block_size", "forbidden"}


def _texts():
    return {p: p.read_text() for p in SOURCES}


def test_every_raised_code_is_in_the_table():
    raised = {(m, p.name) for p, text in _texts().items() for m in RAISED.findall(text)}
    unknown = sorted((code, where) for code, where in raised if code not in BY_CODE)
    assert not unknown, f"codes raised but not in dflash/error_codes.py: {unknown}"
    assert len(raised) > 30  # the pattern does find the raises


def test_every_code_in_the_table_is_used_somewhere():
    text = "\n".join(_texts().values())
    unused = [c.code for c in ERROR_CODES if not re.search(rf"[\"']{c.code}[\"']", text)]
    assert not unused, f"codes in the table that nothing raises: {unused}"
    literal = set(RAISED.findall(text))
    assert {c.code for c in ERROR_CODES} - literal <= INDIRECT  # the rest come from a variable


def test_sqlstates_are_well_formed_and_bad_input_is_22023():
    for c in ERROR_CODES:
        assert re.fullmatch(r"[0-9A-Z]{5}", c.sqlstate), c
        assert c.meaning and not c.meaning.endswith(".")
    assert error_codes.sqlstate("bad_top_p") == ("22023", None)
    assert error_codes.sqlstate("busy")[0] == "DF002"
    assert error_codes.sqlstate("no_such_code") == ("DF000", None)
    assert set(error_codes.FINAL) == {"not_enabled", "row_gone", "truncated"}
    assert error_codes.sqlstate("truncated")[0] == "22001"


def test_the_docs_show_the_table():
    doc = (ROOT / "docs" / "sql.md").read_text()
    start, end = "<!-- error-codes:start -->\n", "<!-- error-codes:end -->"
    shown = doc[doc.index(start) + len(start): doc.index(end)]
    assert shown == error_codes.markdown_table(), "docs/sql.md's error table is stale: paste markdown_table()"


def test_no_second_list_of_sqlstates_or_codes():
    """The bridge, the protocol and the queue read the table; none keeps its own copy."""
    bridge = (ROOT / "plpython" / "dflash_pg.py").read_text()
    assert "error_codes.sqlstate(" in bridge
    mapping = re.compile(r"\"[a-z_]+\":\s*\(\s*\"[0-9A-Z]{5}\"")  # "code": ("SQLSTATE", ...
    assert not mapping.search(bridge)
    assert not re.search(r"\"DF00[0-9]\"", bridge)  # dflash's own class comes from the table only
    for name in ("serve/protocol.py", "serve/queue.py", "serve/server.py", "serve/client.py"):
        text = (ROOT / "worker" / "dflash" / name).read_text()
        assert not mapping.search(text) and not re.search(r"\"(22023|DF00[0-9]|57014)\"", text), name
        assert not re.search(r"\(\s*\"not_enabled\",\s*\"row_gone\"\s*\)", text), name
