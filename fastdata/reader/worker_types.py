"""The kinds of DataLoader workers :func:`fastdata.loader` runs (``worker_type=``), named in one place
for the loader and for the tools that measure them (``fastdata bench``, ``fastdata tune``), which do
not import torch to know them."""

#: ``"process"``: DataLoader worker processes; ``"thread"``: threads of the training process
#: (:mod:`fastdata.reader.threads`)
WORKER_TYPES = ("process", "thread")
