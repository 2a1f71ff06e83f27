"""dflash.bench.humaneval: the code taken from an answer and how it is judged (the model's
code runs in a limited child, never as root)."""

import os

import pytest

from dflash.bench import humaneval as he

PROBLEM = he.humaneval_problems()[0]  # has_close_elements
RIGHT = ("def has_close_elements(numbers, threshold):\n"
         "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n")


def judged(code: str, timeout: float = 10.0):
    return he.run_program(he.program(PROBLEM, code), timeout)


def test_the_first_fenced_block_is_the_code():
    answer = f"Sure:\n```python\n{RIGHT}```\nand\n```python\nprint('other')\n```"
    assert he.extract_code(answer) == RIGHT
    assert he.extract_code(f"```\n{RIGHT}```") == RIGHT
    assert he.extract_code(RIGHT) == RIGHT  # no fence: the whole answer
    assert he.extract_code(f"```python\n{RIGHT}") == RIGHT  # cut off before its closing fence


def test_a_right_answer_passes_and_a_wrong_one_fails():
    assert judged(RIGHT) == (True, "")
    ok, error = judged("def has_close_elements(numbers, threshold):\n    return False\n")
    assert not ok and "AssertionError" in error


def test_a_body_without_the_definition_goes_under_the_prompt():
    body = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
    assert judged(body) == (True, "")


def test_a_program_that_never_ends_is_stopped():
    assert judged("def has_close_elements(numbers, threshold):\n    while True: pass\n", timeout=2) == (
        False, "timed out after 2 s")


@pytest.mark.skipif(os.geteuid() != 0, reason="runs as root only where the bench does")
def test_the_models_code_does_not_run_as_root():
    ok, error = he.run_program("import os\nassert os.geteuid() != 0, 'root'\nopen('/root/x', 'w')\n", 10)
    assert not ok and "PermissionError" in error
