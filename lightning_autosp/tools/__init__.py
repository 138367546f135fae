"""Tools beside the pipeline: the ``autosp`` command line and ``verify``."""
