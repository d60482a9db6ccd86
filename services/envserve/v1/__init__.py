"""Generated protocol stubs for envserve.v1 (do not edit; `make proto` regenerates them)."""
