"""`llmgw keys`: API keys in the live key bucket (docs/keys.md).

- `options`: the subcommands and their options (argparse only);
- `main.run`: the command (create, list, show, update, revoke, seed).
"""
