"""LMDB backend: see ``spec.py`` for the layout."""
