"""A user's function under the kernel protocol: cases, declarations, driver, references, checks."""
