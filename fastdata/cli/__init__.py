"""The ``fastdata`` command: a thin argparse layer over the API (:mod:`fastdata.cli.main`)."""
