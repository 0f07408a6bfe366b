"""``python -m ampgraph``: the ampgraph command line (see ``ampgraph.cli``)."""

from __future__ import annotations

from ampgraph.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
