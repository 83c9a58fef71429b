"""The vocabulary every layer shares: descriptors naming graph inputs and outputs, the analysis
records (what a program does to its inputs, how its outputs alias), the joint graph's layout,
and graphs with their node values as data. It imports no other part of aotgrad but ``_torch``."""
