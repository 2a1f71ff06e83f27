"""Research tools: measurements and experiments that answered a question about the engine.

Not part of the `dflash` package (the worker image does not carry them): they import
dflash, never the other way (tests/test_layers.py). Run them from the repository root,
`python -m tools.NAME --help`; tools/README.md says what each one measures and which page
of docs/ reports it.
"""
