"""The vocabulary every layer shares: descriptors naming graph inputs and outputs, the analysis
records (what a program does to its inputs, how its outputs alias), the joint graph's layout,
graphs with their node values as data, per-operator tables (``ops``: random, side effects,
views) and the graph verifier. It imports only the base modules (``_torch``, ``errors``,
``options``)."""
