"""`python -m kit.images`: image builds (kit.images.build)."""

from kit.images.build import main

raise SystemExit(main())
