"""Thin, optional modules for training frameworks, above the reader (each imports its framework).

``fastdata.integrations.lightning``: :class:`~fastdata.integrations.lightning.StoreDataModule`, a
``LightningDataModule`` over stores. Accelerate and transformers need no module of their own:
``docs/frameworks.md`` says what they do to a loader and why ``fastdata.loader`` works there.
"""
