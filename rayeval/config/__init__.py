"""The sweep's schema: frozen dataclasses, one doc per field and whether it changes a cell's
numbers. The bottom layer with errors.py: every other layer reads these types, and this package
imports nothing of rayeval's (its loader, which checks task and metric names against core's
registries, is plan.loader)."""
