"""The package's version, in a module of its own.

``xmodlm/__init__.py`` offers it as ``xmodlm.__version__``, but that module also
hands out :func:`xmodlm.export.load_pretrained`; a module inside the package
that read the version from there (an export's ``config.json``, the environment
record) would import its way back up to itself. Reading it here keeps it on the
ground floor.
"""

__version__ = "0.1.0"
