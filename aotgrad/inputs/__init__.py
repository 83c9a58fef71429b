"""How a call's arguments become the flat function of tensors every stage works on: a module's
parameters and buffers held per thread (``flatten``), aliased inputs regenerated from one base
(``aliasing``), distributed wrappers refused or unwrapped (``distributed``), a whole training step's
state gathered and installed around each call (``step``), and ``jit``'s options (``jit_options``).
Below ``capture``; the entry points that use them are :mod:`aotgrad.frontend`."""
