"""What runs on every call: the autograd.Function around the compiled graphs
and the epilogue that replays input mutations and regenerates aliases."""
