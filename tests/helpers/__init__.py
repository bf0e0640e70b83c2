"""Helpers shared by the test suite (images, stores, processes, samples, the S3 server).

Test files import them as ``from helpers.images import make_tree``; ``tests/conftest.py``
puts ``tests/`` on ``sys.path`` and holds the fixtures."""
