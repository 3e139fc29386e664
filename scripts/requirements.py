"""Print this package's requirements from pyproject.toml, one per line.

    python scripts/requirements.py [EXTRA ...] [--exclude NAME ...]

Used by scripts/setup_env.sh to add the dependencies to a Python that already has torch_xla,
without letting pip replace that torch / torch_xla.
"""

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def main(argv: list[str]) -> None:
    extras, exclude = [], set()
    target = extras
    for arg in argv:
        if arg == "--exclude":
            target = exclude
        elif target is exclude:
            exclude.add(arg.lower().replace("-", "_"))
        else:
            extras.append(arg)
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    for req in reqs:
        name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower().replace("-", "_")
        if name not in exclude:
            print(req)


if __name__ == "__main__":
    main(sys.argv[1:])
