"""WebDataset tar shards as a write source (``fastdata convert 'shards/train-{000000..000099}.tar' DST``):
:mod:`~fastdata.writer.sources.webdataset.names` (which files), :mod:`~fastdata.writer.sources.webdataset.scan`
(the headers and the fields), :mod:`~fastdata.writer.sources.webdataset.input` (the source and its workers).

The members of each tar are grouped into samples the WebDataset way: a member's *key* is its
path up to the first ``.`` of its file name, its *extension* the rest (``a/0001.seg.png``: key
``a/0001``, extension ``seg.png``), and consecutive members with one key are one sample. Each
extension becomes a field (its name with other characters than letters, digits and ``_`` as
``_``), plus ``__key__``, the key as a string:

==============================================  ============================================
extension                                       field
==============================================  ============================================
``jpg``, ``jpeg``, ``png``, ``webp``, ``tif``,  ``image``-kind: the bytes as they are
``tiff``, ``bmp``, ``ppm`` (and ``*.png`` ...)  (validated, never re-encoded)
``cls``, ``cls2``, ``index``                    ``int`` (decimal text)
``txt``, ``text``                               ``string`` (UTF-8)
``json``, ``jsn``                               ``json`` (the parsed value)
``npy``                                         ``ragged`` (N, ...) of the first one's dtype
anything else                                   the bytes, in a ``json`` field
==============================================  ============================================

The plan is made from the tar headers alone (the main process reads headers, never member
data); the workers read each member's bytes at its offset. Nothing is ever extracted: a
member named with an absolute path or ``..`` only gives a key, links and other non-file
members are skipped (counted in a warning), and a member whose header claims more bytes than
the file holds rejects its sample (reported). A sample that lacks one of the fields, or
whose value does not parse, is rejected and reported (``strict=True`` stops at the first), and so
is one over a limit: a member over ``MAX_MEMBER_BYTES``, members over ``MAX_SAMPLE_BYTES``
together, a JSON member over ``MAX_JSON_MEMBER_BYTES`` (or holding more containers than
:mod:`fastdata.common.bounded` allows), a ``.npy`` header declaring other than the bytes that
follow it, a record readers would refuse. A tar extended header (pax, GNU long name) over
``MAX_EXTENDED_HEADER_BYTES`` (1 MiB) is refused (a ``SourceError`` naming the tar and the
header) before it is read (see docs/SECURITY.md).
Only uncompressed ``.tar`` files (what WebDataset writes) are read: a ``.tar.gz`` is refused
with the command that decompresses it.
"""
