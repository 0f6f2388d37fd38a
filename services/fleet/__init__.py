"""`llmgw endpoints` and the admin HTTP API of the live fleet (docs/architecture.md, "Live fleet")."""
