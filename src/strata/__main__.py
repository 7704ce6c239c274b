"""`python -m strata`: the `strata` command."""

from .cli import main

raise SystemExit(main())
