from attn_ledger.cli import main

main()
