"""The cache: its format (the contract), the writer (atomic, staged) and the reader (verify, inspect)."""
