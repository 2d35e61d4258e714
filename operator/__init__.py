"""The kopf operator, importable as ``policy_operator.operator`` (never as ``operator``).

Run Python with this repository's root on ``sys.path`` only after the standard
library's ``operator`` is imported (any installed venv does that at start-up),
so this folder never shadows it; the Makefile calls ``.venv/bin/pip`` rather
than ``python -m pip`` for that reason.
"""
