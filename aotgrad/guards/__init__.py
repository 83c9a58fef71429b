"""Guards: what a compiled graph assumed about its inputs, checked as generated code."""
