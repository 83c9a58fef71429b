"""Frontends: turn a user's function or module and its arguments into a flat
function of tensors (stage 0, :class:`aotgrad.stages.Setup`)."""
