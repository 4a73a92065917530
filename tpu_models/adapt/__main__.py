"""Prints the ledger of adaptations (docs/adaptations.md)."""

from tpu_models.adapt import ledger

print(ledger(), end="")
