"""`ckptwatch lint`'s analysis: checkpoint writes that more than one rank can reach.

Pure and standard-library only (the `ast` module): source text in, findings out. The command
line (file discovery, output formats, exit codes) is monitor/cli/lint.py.
"""
from monitor.lint.checker import CODES, LintFinding, lint_source

__all__ = ["CODES", "LintFinding", "lint_source"]
