"""met's kernel layer: the machine's capability (probed once), the native CPU extensions
and the linear-method and attention-backend registries. Nothing above this package knows
an ISA; nothing here imports anything of met's above it."""
