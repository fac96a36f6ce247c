"""qkov_lib: the shared library of the qkov book (Vashisht & Ramaswamy, ICML 2026)."""

__version__ = "0.1.0"
