"""Thin, optional modules for training frameworks and data engines, above the reader and the
writer (each imports its framework).

``fastdata.integrations.lightning``: :class:`~fastdata.integrations.lightning.StoreDataModule`, a
``LightningDataModule`` over stores. ``fastdata.integrations.ray``: a ``ray.data.Dataset`` written
into one store (each Ray task a part, the driver publishes once) and a store read as one.
Accelerate and transformers need no module of their own: ``docs/frameworks.md`` says what they do
to a loader and why ``fastdata.loader`` works there.
"""
