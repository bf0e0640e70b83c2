"""HDF5 backend: see ``spec.py`` for the layout."""
