"""`python -m kit.bench`: the bench (kit.bench.run)."""

from kit.bench.run import main

raise SystemExit(main())
