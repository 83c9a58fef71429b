"""Differential suite: a table of small programs x every aotgrad entry point, each compared with eager."""
