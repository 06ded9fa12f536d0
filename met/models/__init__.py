"""Model families, one file each, and the registry that maps HF architectures to them."""
