"""One exception type for bad input, with a stable machine-readable code.

Everything a caller can get wrong (a parameter, a prompt, a checkpoint) raises
`DFlashError`; the CLI prints its message without a traceback and the worker
turns it into a structured error frame.
"""


class DFlashError(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message}
