"""Loading what a capture and compile stored, into stage objects: an export artifact (``loader``,
``rebuild``, ``verify``, ``held``) and the disk cache's entries (``entry``). Writing and the formats
themselves are :mod:`aotgrad.store`'s."""
