"""`python -m torchtitan_xla.config [--markdown]`: the option reference (docs/config.md)."""

import sys

from torchtitan_xla.config.reference import help_text, markdown_reference

if sys.argv[1:] == ["--markdown"]:
    sys.stdout.write(markdown_reference())
else:
    print(help_text())
