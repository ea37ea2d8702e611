"""Checkpoint verification: zip structure, tensor sizes, CRC32. Never imports torch."""
