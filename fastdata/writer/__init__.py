"""The writer: every way of making a store goes through one write session
(:mod:`fastdata.writer.session`), which owns the destination checks, the lock,
resume/overwrite, staging, progress, the report and the recorded options; the
pipeline (:mod:`fastdata.writer.pipeline`) runs worker processes and shard writers;
sources (:mod:`fastdata.writer.sources`) turn inputs into work for it.

Never imports :mod:`fastdata.reader`."""
