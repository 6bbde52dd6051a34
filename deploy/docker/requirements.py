"""Print the third-party requirements of the repository's distributions named on the command line
(`libs/brigade[ml] services/rollout ...`), one a line, without the distributions themselves.

The Dockerfiles install these (with -c constraints.txt) from the pyproject files alone, before any
code is copied, so a code change reuses the dependency layer instead of reinstalling it."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extra_names(extras: str) -> list[str]:
    """"" (the plain dependencies) and each extra of "ml,plots"."""
    return ["", *(e.strip() for e in extras.split(",") if e.strip())]


def third_party(args: list[str]) -> list[str]:
    projects, wanted = {}, []
    for arg in args:
        folder, _, extras = arg.partition("[")
        project = tomllib.loads((Path(folder) / "pyproject.toml").read_text())["project"]
        projects[canonical(project["name"])] = project
        wanted += [(canonical(project["name"]), e) for e in extra_names(extras.rstrip("]"))]
    out, seen = [], set()
    while wanted:
        name, extra = wanted.pop(0)
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        project = projects[name]
        reqs = project["optional-dependencies"][extra] if extra else project.get("dependencies", [])
        for req in reqs:
            dep, _, rest = re.match(r"([A-Za-z0-9._-]+)(\[([^\]]*)\])?", req).groups()
            if canonical(dep) in projects:  # one of ours: its extras' requirements count, itself does not
                wanted += [(canonical(dep), e) for e in extra_names(rest or "")]
            elif req not in out:
                out.append(req)
    return out


if __name__ == "__main__":
    print("\n".join(third_party(sys.argv[1:])))
