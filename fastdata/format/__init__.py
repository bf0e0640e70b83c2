"""The on-disk contract of a store: file names (:mod:`~fastdata.format.names`), field kinds
(:mod:`~fastdata.format.fields`), the manifest, the store index, records, and the storage
backends with their registry (:mod:`~fastdata.format.backends`).

Both the writer and the readers build on this layer; it imports neither of them."""
