"""Speed and compile-time measurements: aotgrad vs eager vs PyTorch's AOT autograd."""
