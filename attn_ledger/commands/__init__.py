"""One module per CLI command. Each parses options, calls the library, and renders.

Modules here import neither torch nor the library at top level, so that
``attn-ledger --help`` stays fast; the work is imported inside each command.
"""
