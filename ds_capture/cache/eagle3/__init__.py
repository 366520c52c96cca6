"""The EAGLE-3 cache kind: NeMo AutoModel 0.7.0's EAGLE-3 offline cache (format v2): format, writer,
reader / verify / compare, the draft distribution, and the kind the runner drives."""
