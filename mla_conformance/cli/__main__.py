"""``python -m mla_conformance.cli``: the ``mla-conformance`` command."""
from mla_conformance.cli import main

raise SystemExit(main())
