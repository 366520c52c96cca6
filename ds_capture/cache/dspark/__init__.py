"""The DSpark cache kind: NeMo AutoModel 0.7.0's DSpark offline cache (format v1): format, writer,
reader / verify, compare, and the kind the runner drives."""
