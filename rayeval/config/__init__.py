"""The sweep's schema (frozen dataclasses, one docstring per field) and its loader."""
