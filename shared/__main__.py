"""`python -m llmgw ...` is the same as the `llmgw` console script."""

from llmgw.cli import main

raise SystemExit(main())
