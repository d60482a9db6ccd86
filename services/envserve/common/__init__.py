"""Pieces several parts of envserve share and none of them owns: any part may import this package,
and it imports nothing else of envserve (tests/unit/test_import_arrows.py checks both)."""
