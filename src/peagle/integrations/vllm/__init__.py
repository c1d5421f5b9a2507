"""vLLM in its own environment: `process` finds the interpreter and runs `runner.py` there (a script that imports
nothing from peagle).  Importing this package imports neither."""
