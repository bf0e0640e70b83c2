"""Storage backends. Each backend only encodes and decodes its shard files; the writer
pipeline and the datasets are shared. Backends are declared in one place:
:mod:`fastdata.format.backends.registry`."""
